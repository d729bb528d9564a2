"""Engine integrations: one module per engine, each importing its engine lazily.

- :mod:`fstier.integrations.vllm`: ``FstierTier``, a vLLM secondary KV
  offload tier (``{"type": "FstierTier", "module_path":
  "fstier.integrations.vllm", "root_dir": ...}`` in
  ``kv_connector_extra_config.secondary_tiers``).

Importing this package never imports an engine: ``import fstier`` and
``import fstier.integrations`` stay engine-free; only importing an
integration module does, and then only if the engine is installed.
"""

from __future__ import annotations

__all__: list[str] = []
