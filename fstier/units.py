"""Byte sizes with units ("512MiB", "2TB", "870Gi", "4096").

Three spellings are accepted everywhere: decimal units (``kB``, ``MB``,
``GB``, ``TB``, ``PB``: powers of 1000), binary units (``KiB`` .. ``PiB``:
powers of 1024) and Kubernetes' binary forms (``Ki``, ``Mi``, ``Gi``,
``Ti``, ``Pi``). A bare single letter (``2T``) is ambiguous between tools:
fstier's YAML and CLI read it as decimal (2 TB), and vLLM's JSON, where
vLLM's own ``human_readable_int`` reads an upper-case letter as binary and a
lower-case one as decimal, gets vLLM's meaning with ``vllm_letters=True``
(``2T`` = 2 TiB, ``2t`` = 2 TB). Pure functions, no I/O.
"""

from __future__ import annotations

import math
import re

__all__ = ["MAX_SIZE", "format_size", "parse_size"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1024,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1024**4,
    "p": 1000**5,
    "pb": 1000**5,
    "pib": 1024**5,
    # Kubernetes resource quantities (870Gi, 2Ti).
    "ki": 1024,
    "mi": 1024**2,
    "gi": 1024**3,
    "ti": 1024**4,
    "pi": 1024**5,
}
#: vLLM's single-letter suffixes (``vllm.utils.argparse_utils.human_readable_int``):
#: upper case binary, lower case decimal.
_VLLM_LETTERS = {
    "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4,
    "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4,
}
_FORMS = "B, kB, MB, GB, TB, KiB, MiB, GiB, TiB or Kubernetes' Ki, Mi, Gi, Ti"
#: The largest size any option may name: the largest off_t (8 EiB).
MAX_SIZE = (1 << 63) - 1

_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_size(value: object, *, vllm_letters: bool = False) -> int:
    """Return ``value`` as a non-negative number of bytes.

    Accepts ints and strings such as ``"512MiB"``, ``"2TB"``, ``"1.5GiB"``,
    ``"870Gi"``. Decimal units (kB, MB, GB, TB) are powers of 1000, binary
    units (KiB, MiB, GiB, TiB and Kubernetes' Ki, Mi, Gi, Ti) powers of 1024.
    A bare letter (``2T``) is decimal, or with ``vllm_letters`` what vLLM
    reads it as: upper case binary (2 TiB), lower case decimal. Raises
    ``ValueError`` with the accepted forms.
    """
    if isinstance(value, bool):
        raise ValueError(f"expected a size such as 4096, '512MiB' or '2TB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must be >= 0, got {value}")
        return _in_range(value, value)
    if isinstance(value, float):
        if not math.isfinite(value) or value < 0 or value != int(value):
            raise ValueError(f"size must be a whole number of bytes >= 0, got {value}")
        return _in_range(int(value), value)
    if not isinstance(value, str):
        raise ValueError(f"expected a size such as 4096, '512MiB' or '2TB', got {value!r}")
    m = _SIZE_RE.match(value)
    if not m:
        raise ValueError(f"expected a size such as 4096, '512MiB' or '2TB', got {value!r}")
    number, unit = m.groups()
    mult = _VLLM_LETTERS.get(unit) if vllm_letters else None
    if mult is None:
        mult = _UNITS.get(unit.lower())
    if mult is None:
        raise ValueError(f"unknown size unit {unit!r} in {value!r}; use {_FORMS}")
    size = float(number) * mult
    # A long enough digit string overflows to inf, which int() refuses with
    # OverflowError (not a ValueError, so it escaped config validation).
    if not math.isfinite(size) or size > MAX_SIZE:
        raise ValueError(f"size must be at most {MAX_SIZE} bytes (the largest file offset), got {value!r}")
    if size != int(size):
        raise ValueError(f"size {value!r} is not a whole number of bytes")
    return int(size)


def _in_range(size: int, given: object) -> int:
    if size > MAX_SIZE:
        raise ValueError(f"size must be at most {MAX_SIZE} bytes (the largest file offset), got {given!r}")
    return size


def format_size(num: float) -> str:
    """Human-readable binary size, e.g. ``1.5 GiB``."""
    n = float(num)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        # Compare what will be printed, not the raw value: 1073741823 bytes
        # is 1023.99... MiB, which rounds to "1024.0 MiB" where "1.0 GiB" is meant.
        shown = round(n) if unit == "B" else round(n, 1)
        if abs(shown) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"
