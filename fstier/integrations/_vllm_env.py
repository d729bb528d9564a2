"""fstier inside vLLM's process: its log lines and its block-hash seed.

* :func:`join_vllm_logging`: fstier's loggers print through vLLM's
  handlers, in vLLM's format and at its level, unless the operator
  configured logging; called once when a tier is built.
* :func:`hash_seed_problem`: why vLLM's block hashes in this process can
  never match another process's (a random seed), or None; reads two
  attributes of vLLM's ``kv_cache_utils``.

Importing this module never imports vLLM; each function imports it, if at
all, when called.
"""

from __future__ import annotations

import logging

__all__ = ["hash_seed_problem", "join_vllm_logging"]


def join_vllm_logging() -> bool:
    """Send fstier's log lines (loggers ``fstier.*``) through vLLM's handlers,
    so they print in vLLM's format at vLLM's level (``VLLM_LOGGING_LEVEL``).

    vLLM configures only its own ``vllm`` logger (``propagate: False``) and
    leaves the root logger bare, so without this fstier's INFO lines (the
    start line naming root, namespace and row size) never print and its
    warnings reach stderr unformatted. Nothing changes when the operator
    configured logging: a ``fstier`` logger with handlers (e.g. from
    ``VLLM_LOGGING_CONFIG_PATH``) or a root logger with handlers is left
    alone, and so is a vLLM run with ``VLLM_CONFIGURE_LOGGING=0``. Returns
    True when it attached vLLM's handlers."""
    fst = logging.getLogger("fstier")
    if fst.handlers or logging.getLogger().handlers:
        return False
    vl = logging.getLogger("vllm")
    if not vl.handlers:
        return False
    for handler in vl.handlers:
        fst.addHandler(handler)
    if fst.level == logging.NOTSET:
        fst.setLevel(vl.getEffectiveLevel())
    # vLLM's handlers print these lines; a root handler added later must not
    # print them a second time.
    fst.propagate = False
    return True


def hash_seed_problem() -> str | None:
    """Why vLLM's block hashes in this process cannot match another
    process's, or None. vLLM seeds its prefix hashes (``NONE_HASH``) from
    ``PYTHONHASHSEED``, else from a fixed default for sha256 but from random
    bytes for a non-cryptographic algorithm (``xxhash``): then every restart
    and every other instance computes other keys and never hits a stored file.
    None too while vLLM has not seeded yet (its engine core does it after the
    scheduler, and so this tier, is built)."""
    import os

    if os.environ.get("PYTHONHASHSEED") is not None:
        return None
    try:
        from vllm.v1.core import kv_cache_utils
    except Exception:
        return None
    seed = getattr(kv_cache_utils, "_NONE_HASH_SEED", None)
    default = getattr(kv_cache_utils, "DEFAULT_NONE_HASH_SEED", None)
    if seed is None or default is None or seed == default:
        return None
    return (
        "vLLM's prefix-cache hash seed is random in this process (a non-cryptographic "
        "--prefix-caching-hash-algo such as xxhash, and PYTHONHASHSEED is not set): block "
        "hashes differ in every process, so nothing this tier stores is hit after a restart or "
        "by another instance; set PYTHONHASHSEED to the same value for every vLLM instance "
        "sharing the root, or use --prefix-caching-hash-algo sha256"
    )
