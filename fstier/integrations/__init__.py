"""Engine integrations: one module per engine, each importing its engine lazily.

- :mod:`fstier.integrations.vllm`: ``FstierTier``, a vLLM secondary KV
  offload tier (``{"type": "FstierTier", "module_path":
  "fstier.integrations.vllm", "root_dir": ...}`` in
  ``kv_connector_extra_config.secondary_tiers``);
- :mod:`fstier.integrations.vllm_cpu`: ``FstierCpuOffloadingSpec``, vLLM's
  tiering spec with a worker for its CPU backend;
- :mod:`fstier.integrations.sglang`: ``FstierHiCacheStorage``, an SGLang
  HiCache storage backend (SGLang's ``dynamic`` backend);
- :mod:`fstier.integrations.lmcache`: ``FstierL2Adapter``, an LMCache L2
  adapter, with :mod:`~fstier.integrations.lmcache_space` (LMCache's keys and
  values as namespaces, block keys and lent slots),
  :mod:`~fstier.integrations.lmcache_keys` (its key listing and deletion) and
  :mod:`~fstier.integrations.lmcache_tasks` (the adapter's book-keeping).

The ``_``-named modules beside them hold what those modules translate with:
options (``_options``), each engine's version check and configuration
(``_vllm_compat``, ``_vllm_config``, ``_vllm_env``, ``_sglang_compat``),
vLLM's metric tables (``_vllm_metrics``), SGLang's host-pool geometry
(``_sglang_pool``) and jobs waited for inside a call (``_blocking``).

Importing this package never imports an engine: ``import fstier`` and
``import fstier.integrations`` stay engine-free; only importing an
integration module does, and then only if the engine is installed.
"""

from __future__ import annotations

__all__: list[str] = []
