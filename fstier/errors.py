"""The fstier error hierarchy.

Every error fstier raises on purpose is a :class:`FstierError`. A subclass may
also inherit the builtin it refines so that callers who catch ``ValueError`` or
``OSError`` keep working. Partial progress is a real field
(:attr:`PartialLoadError.num_loaded`), never an attribute glued onto an
``OSError``.
"""

from __future__ import annotations


class FstierError(Exception):
    """Base class of every error fstier raises deliberately."""


class ConfigError(FstierError, ValueError):
    """A configuration value is invalid. The message is one line naming the
    field path, the bad value and what is expected."""


class KeyFormatError(FstierError, ValueError):
    """A block key is malformed (wrong type, length or group index)."""


class NamespaceMismatchError(FstierError):
    """A namespace directory already holds a manifest that differs from ours."""


class BlockCorruptError(FstierError, ValueError):
    """A block file is proven bad (short, bad checksum, wrong key/namespace or
    wrong length). ``reason`` is a short machine-readable cause."""

    def __init__(self, reason: str, detail: str = "") -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}" if detail else reason)


class PartialLoadError(FstierError):
    """A batched load stopped early; ``num_loaded`` leading blocks are good."""

    def __init__(self, num_loaded: int, cause: str, detail: str = "") -> None:
        self.num_loaded = num_loaded
        self.cause = cause
        self.detail = detail
        super().__init__(
            f"loaded {num_loaded} block(s) before {cause}" + (f": {detail}" if detail else "")
        )


class DirectIOUnsupportedError(FstierError, OSError):
    """``o_direct: on`` was configured but the filesystem refuses O_DIRECT."""


class LayoutError(FstierError, ValueError):
    """A KV cache tensor or page mapping cannot be registered or certified."""


class PoolExhaustedError(FstierError, RuntimeError):
    """The host block pool has no free slot."""


class PoolError(FstierError, RuntimeError):
    """Misuse of the host block pool (double free, unknown slot, missing segment)."""


class PathSafetyError(FstierError, ValueError):
    """A path would leave the root or crosses a symlink."""


class MetricsUnavailableError(FstierError, ImportError):
    """Prometheus export was asked for but the ``metrics`` extra
    (prometheus-client) is not installed."""


class TierClosedError(FstierError, RuntimeError):
    """An operation was attempted on an FsTier after ``close()``."""


class IOPoolClosedError(FstierError, RuntimeError):
    """Work was submitted to an I/O pool after ``shutdown()``."""


class StorageError(FstierError, OSError):
    """The cache root or namespace directory cannot be created or written
    (permissions, read-only mount, full disk) at start-up. ``errno`` is kept."""

    def __init__(self, message: str, errno: int | None = None) -> None:
        super().__init__(errno, message)
        self.message = message

    def __str__(self) -> str:
        return self.message
