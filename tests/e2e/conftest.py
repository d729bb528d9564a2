"""End-to-end tests with a real vLLM engine (``make e2e``).

They run only with ``FSTIER_E2E=1`` (set by ``make e2e``, which builds the
engine venv ``.venv-e2e`` first); in the regular suite they are skipped as a
whole. Every engine is a child process in its own process group; the harness
kills what is left of it and removes the ``/dev/shm`` files of the engine ids
its log names, on success and on failure.
"""

from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("FSTIER_E2E") == "1":
        return
    skip = pytest.mark.skip(reason="end-to-end engine tests: run `make e2e` (FSTIER_E2E=1)")
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(skip)
