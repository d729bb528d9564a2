"""The vocabulary every block I/O backend shares: how a store or load is
done (:class:`IOOptions`), what is asked (:class:`StoreRequest`,
:class:`LoadRequest`) and what happened (:class:`StoreStatus` /
:class:`StoreOutcome`, :class:`LoadStatus` / :class:`LoadOutcome`).

The Python backend (:mod:`fstier.io._blockio`) and the native one
(:mod:`fstier.io.native`) both answer in these types, with the same statuses,
causes (errno names) and reasons, so :class:`fstier.io.blockstore.BlockStore`
and the tier handle either with one code path.

Invariants
    Outcomes are frozen values. Only ``LoadStatus.LOADED`` means a buffer
    holds verified bytes; ``StoreStatus.FAILED`` means nothing was published.
    Costs: plain slotted dataclasses; nothing here does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING

from fstier.io.blockfile import ALIGNMENT, BlockHeader
from fstier.io.capabilities import RootCapabilities
from fstier.keys import BlockKey

if TYPE_CHECKING:  # pragma: no cover
    from fstier.config import TierConfig
    from fstier.io.capabilities import DirectIOSupport

__all__ = [
    "IOOptions",
    "LoadOutcome",
    "LoadRequest",
    "LoadStatus",
    "StoreOutcome",
    "StoreRequest",
    "StoreStatus",
]


# ------------------------------------------------------------------- options
@dataclass(frozen=True, slots=True)
class IOOptions:
    """How one store or load is performed."""

    o_direct: bool = False
    #: buffered I/O, but a load of a file of at least 1 MiB with no page in
    #: the page cache reads it with O_DIRECT (``o_direct: cold``; the native
    #: path only: the Python path reads such files buffered)
    o_direct_cold: bool = False
    alignment: int = ALIGNMENT
    fsync: str = "none"
    file_mode: int = 0o644
    checksum: bool = True
    #: the root's capabilities (O_TMPFILE refusal is remembered there);
    #: None: every store tries O_TMPFILE and falls back for itself only
    capabilities: RootCapabilities | None = None

    def __post_init__(self) -> None:
        if self.fsync not in ("none", "file", "file+dir"):
            raise ValueError(
                f"IOOptions.fsync must be 'none', 'file' or 'file+dir', got {self.fsync!r}"
            )
        if self.alignment < 1 or ALIGNMENT % self.alignment:
            raise ValueError(f"IOOptions.alignment must divide {ALIGNMENT}, got {self.alignment}")

    @classmethod
    def from_tier(cls, tier: TierConfig, support: DirectIOSupport | RootCapabilities) -> IOOptions:
        """Options for a tier config and its root's capabilities (or just
        its directory's O_DIRECT probe result)."""
        caps = support if isinstance(support, RootCapabilities) else None
        dio = support.o_direct if isinstance(support, RootCapabilities) else support
        cold = tier.o_direct == "cold"
        direct = dio.enabled and not cold
        # Buffered on a filesystem that reports write errors late (a full
        # CephFS pool dropped acknowledged stores): acknowledge only what an
        # fsync confirmed (fstier.io.capabilities).
        late = caps is not None and caps.late_write_errors and not direct
        return cls(
            o_direct=direct,
            o_direct_cold=dio.enabled and cold,
            alignment=dio.alignment,
            fsync="file" if late and tier.fsync == "none" else tier.fsync,
            file_mode=tier.file_mode,
            checksum=tier.checksum != "none",
            capabilities=caps,
        )



# --------------------------------------------------------------------- store
class StoreStatus(str, Enum):
    """Result of one store. The values equal the names, so ``== "STORED"`` works."""

    STORED = "STORED"
    SKIPPED = "SKIPPED"
    FAILED = "FAILED"


@dataclass(frozen=True, slots=True)
class StoreRequest:
    """Write ``header`` then exactly ``header.payload_len`` bytes of
    ``payload`` to ``path`` (the caller's buffer is only read, never written:
    the file's zero padding after the payload comes from a bounce page).
    Whole pages of a 4096-aligned payload go to the file directly (O_DIRECT
    capable)."""

    path: str | Path
    header: BlockHeader
    payload: memoryview


@dataclass(frozen=True, slots=True)
class StoreOutcome:
    """What happened to one store: ``cause`` is an errno name (``ENOSPC``) or a
    short reason, ``detail`` says at which step, ``nbytes`` is bytes written."""

    status: StoreStatus
    cause: str = ""
    detail: str = ""
    nbytes: int = 0

    @property
    def ok(self) -> bool:
        return self.status is not StoreStatus.FAILED


# ---------------------------------------------------------------------- load
class LoadStatus(str, Enum):
    """Result of one load. The values equal the names, so ``== "LOADED"`` works."""

    LOADED = "LOADED"
    MISSING = "MISSING"
    CORRUPT = "CORRUPT"
    ERROR = "ERROR"


@dataclass(frozen=True, slots=True)
class LoadRequest:
    """Load the file at ``path`` into ``buffer[:payload_len]`` (any alignment;
    O_DIRECT when enabled and the buffer starts 4096-aligned) and check that it holds ``key`` of namespace
    ``namespace_digest`` with exactly ``payload_len`` payload bytes."""

    path: str | Path
    buffer: memoryview
    key: BlockKey
    namespace_digest: bytes
    payload_len: int


@dataclass(frozen=True, slots=True)
class LoadOutcome:
    """What happened to one load. ``removed`` is true when a corrupt file was
    unlinked. Only LOADED means the buffer holds verified bytes."""

    status: LoadStatus
    cause: str = ""
    detail: str = ""
    nbytes: int = 0
    removed: bool = False

    @property
    def ok(self) -> bool:
        return self.status is LoadStatus.LOADED
