"""Which SGLang FstierHiCacheStorage works with, and its options.

* :func:`check_supported`: the installed SGLang (its distribution's
  version, read without importing SGLang) against :data:`SUPPORTED_SGLANG`;
  one :class:`SglangUnavailableError` naming what is installed, what is
  supported and the fix.
* :func:`tier_config_from_extra_config`: SGLang's
  ``--hicache-storage-backend-extra-config`` as a
  :class:`~fstier.config.TierConfig`: SGLang's own keys set aside, the rest
  fstier's options, the first bad key one :class:`~fstier.errors.ConfigError`.
* :func:`sglang_metrics_port`: the port this rank serves fstier's metrics
  on (``metrics_port`` plus the rank's index), or None.

Importing this module never imports SGLang; each call reads package metadata
or a dict only.
"""

from __future__ import annotations

import importlib.metadata
import re
from typing import Any

from fstier.config import TierConfig
from fstier.errors import ConfigError, FstierError
from fstier.integrations._exporter import check_metrics_port
from fstier.integrations._options import tier_config_from_engine_options

__all__ = [
    "SUPPORTED_SGLANG",
    "SglangUnavailableError",
    "check_supported",
    "sglang_metrics_port",
    "sglang_version",
    "tier_config_from_extra_config",
]

#: The SGLang versions FstierHiCacheStorage is tested against (the HiCache
#: storage interface changes between minor versions).
SUPPORTED_SGLANG = ">=0.5.23,<0.6"
_MIN_VERSION = (0, 5, 23)
_MAX_VERSION_EXCL = (0, 6, 0)

_DOC = "docs/sglang.md"

#: Keys SGLang itself reads from (or leaves in) the extra config.
_SGLANG_KEYS = frozenset(
    {
        "backend_name",
        "module_path",
        "class_name",
        "interface_v1",
        "tp_lcm_size",
        "prefetch_threshold",
        "prefetch_timeout_base",
        "prefetch_timeout_per_ki_token",
        "hicache_storage_pass_prefix_keys",
    }
)


class SglangUnavailableError(FstierError, ImportError):
    """SGLang is missing, not importable, or outside the supported versions."""


def sglang_version() -> str | None:
    """The installed SGLang distribution's version, or None (never imports SGLang)."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def _version_tuple(version: str) -> tuple[int, ...]:
    m = re.match(r"^\s*v?(\d+(?:\.\d+)*)", version)
    if m is None:
        return ()
    parts = tuple(int(p) for p in m.group(1).split("."))
    return parts + (0,) * (3 - len(parts))


def check_supported(installed: str | None, import_error: BaseException | None) -> str:
    """Return ``installed`` (SGLang's version, or None if it is not
    installed) if FstierHiCacheStorage supports it and SGLang's HiCache
    storage module imported (``import_error`` is None), else raise
    :class:`SglangUnavailableError` naming what is installed and what is
    supported."""
    fix = (
        "install a supported SGLang (pip install sglang==0.5.23 on a GPU machine; on a "
        "CPU-only machine `make test-sglang` builds the test environment; see docs/sglang.md)"
    )
    if installed is None:
        raise SglangUnavailableError(
            f"FstierHiCacheStorage needs SGLang {SUPPORTED_SGLANG}, but SGLang is not "
            f"installed; {fix}"
        )
    if not _MIN_VERSION <= _version_tuple(installed) < _MAX_VERSION_EXCL:
        raise SglangUnavailableError(
            f"FstierHiCacheStorage needs SGLang {SUPPORTED_SGLANG}, but SGLang {installed} "
            f"is installed; {fix}"
        )
    if import_error is not None:
        raise SglangUnavailableError(
            f"FstierHiCacheStorage needs SGLang {SUPPORTED_SGLANG}; SGLang {installed} is "
            f"installed but its HiCache storage module does not import "
            f"({type(import_error).__name__}: {import_error}); {fix}"
        )
    return installed


def tier_config_from_extra_config(extra_config: dict[str, Any] | None) -> TierConfig:
    """The :class:`TierConfig` of SGLang's extra config: SGLang's own keys
    are set aside, the rest are fstier's options (``root_dir``, ``config``,
    tier fields). Raises :class:`ConfigError` naming the first bad key."""
    if extra_config is not None and not isinstance(extra_config, dict):
        raise ConfigError(
            "FstierHiCacheStorage: --hicache-storage-backend-extra-config must be a JSON "
            f"object, got {type(extra_config).__name__}"
        )
    opts = {k: v for k, v in (extra_config or {}).items() if k not in _SGLANG_KEYS}
    check_metrics_port(opts.pop("metrics_port", None), "FstierHiCacheStorage", _DOC)
    return tier_config_from_engine_options(
        opts,
        who="FstierHiCacheStorage",
        engine="SGLang",
        engine_keys=_SGLANG_KEYS,
        aliases={},
        doc=_DOC,
    )


def sglang_metrics_port(storage_config: Any) -> int | None:
    """The port this SGLang rank serves fstier's metrics on: the extra
    config's ``metrics_port`` plus the rank's index among the scheduler
    processes (``tp_rank + tp_size * (pp_rank + pp_size * dp_rank)``), so the
    ranks of one host never ask for one port; None without ``metrics_port``."""
    extra = storage_config.extra_config or {}
    base = check_metrics_port(extra.get("metrics_port"), "FstierHiCacheStorage", _DOC)
    if base is None:
        return None
    c = storage_config
    tp, pp = int(c.tp_size or 1), int(c.pp_size or 1)
    rank = int(c.tp_rank or 0) + tp * (int(c.pp_rank or 0) + pp * int(c.dp_rank or 0))
    return check_metrics_port(base + rank, "FstierHiCacheStorage", _DOC)
