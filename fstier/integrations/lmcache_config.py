"""Which LMCache ``FstierL2Adapter`` runs with, and its ``adapter_params``.

* :func:`lmcache_version`: the installed LMCache if it is one of
  :data:`SUPPORTED_LMCACHE` and its L2 adapter modules import, else one
  :class:`LmcacheUnavailableError` naming what is installed.
* :func:`tier_config_from_adapter_params`: ``adapter_params`` as a
  :class:`~fstier.config.TierConfig`, checked like every fstier config
  (one :class:`~fstier.errors.ConfigError` naming the key); ``o_direct``
  left unset is :data:`DEFAULT_O_DIRECT`; ``metrics_port`` (fstier's own
  Prometheus exporter, :mod:`fstier.integrations._exporter`) is set aside.
* :func:`metrics_port_from_adapter_params`: that ``metrics_port``, checked.

Importing this module imports neither LMCache nor torch; costs nothing
beyond one package metadata read per check.
"""

from __future__ import annotations

from importlib import metadata
from typing import TYPE_CHECKING, Any

from fstier.errors import ConfigError, FstierError
from fstier.integrations._exporter import check_metrics_port
from fstier.integrations._options import tier_config_from_engine_options

if TYPE_CHECKING:  # pragma: no cover
    from fstier.config import TierConfig

__all__ = [
    "DEFAULT_O_DIRECT", "SUPPORTED_LMCACHE", "LmcacheUnavailableError", "lmcache_version",
    "metrics_port_from_adapter_params", "tier_config_from_adapter_params",
]

_DOC = "docs/lmcache.md"

#: LMCache releases whose L2 adapter interface this module implements.
SUPPORTED_LMCACHE = ("0.5",)


class LmcacheUnavailableError(FstierError):
    """LMCache is not installed, not importable, or of an unsupported version."""


def lmcache_version(import_error: BaseException | None = None) -> str:
    """The installed LMCache version if ``FstierL2Adapter`` supports it
    (``import_error``: why its L2 adapter modules did not import, if they
    did not), else :class:`LmcacheUnavailableError` naming what is installed."""
    try:
        version = metadata.version("lmcache")
    except metadata.PackageNotFoundError:
        raise LmcacheUnavailableError(
            "FstierL2Adapter needs LMCache (0.5.x); it is not installed: see docs/lmcache.md "
            "for the CPU install (`make test-lmcache` builds .venv-lmcache)"
        ) from None
    if not version.startswith(tuple(v + "." for v in SUPPORTED_LMCACHE)):
        raise LmcacheUnavailableError(
            f"FstierL2Adapter supports LMCache {', '.join(v + '.x' for v in SUPPORTED_LMCACHE)}; "
            f"{version} is installed"
        )
    if import_error is not None:
        raise LmcacheUnavailableError(
            f"LMCache {version} is installed but its L2 adapter modules do not import: {import_error}"
        )
    return version


#: The adapter's own default for ``o_direct`` where neither ``adapter_params``
#: nor the ``config`` YAML sets it: ``cold``, buffered I/O like LMCache's
#: disk adapters except that a chunk of 1 MiB or more found wholly outside
#: the page cache is read with O_DIRECT. LMCache's L1 already keeps hot
#: chunks in its own memory; the page cache keeps the chunks L1 let go for
#: free (the kernel reclaims it under pressure), and all-direct I/O made
#: every such load a device read (docs/lmcache.md, "Numbers": 0.1-0.2x on
#: warm loads); a large cold chunk reads faster direct (median 1.38x).
DEFAULT_O_DIRECT = "cold"


def tier_config_from_adapter_params(params: Any) -> TierConfig:
    """The :class:`~fstier.config.TierConfig` of ``adapter_params``
    (``o_direct`` unset: :data:`DEFAULT_O_DIRECT`; ``metrics_port`` is
    :func:`metrics_port_from_adapter_params`'s)."""
    metrics_port_from_adapter_params(params)
    tier = tier_config_from_engine_options(
        {k: v for k, v in params.items() if k != "metrics_port"},
        who="FstierL2Adapter", engine="LMCache", engine_keys=(), aliases={}, doc=_DOC,
    )
    if "o_direct" not in tier.model_fields_set:
        tier = tier.model_copy(update={"o_direct": DEFAULT_O_DIRECT})
    return tier


def metrics_port_from_adapter_params(params: Any) -> int | None:
    """``adapter_params``' ``metrics_port`` (None: not given): the port the
    adapter's process serves fstier's metrics on, or one
    :class:`ConfigError` naming it."""
    if not isinstance(params, dict):
        raise ConfigError(
            f"FstierL2Adapter adapter_params: expected a JSON object such as "
            f'{{"root_dir": "/mnt/kv"}}, got {type(params).__name__}; see {_DOC}'
        )
    return check_metrics_port(params.get("metrics_port"), "FstierL2Adapter", _DOC)
