"""Shared fixtures: small model/tier configs built on real tmp_path roots."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from fstier.config import FstierConfig, parse_config
from fstier.errors import ConfigError


def make_config(root: Path, *, groups: list[dict[str, Any]] | None = None, **over: Any) -> FstierConfig:
    """A valid FstierConfig; ``over`` keys are section dicts merged shallowly."""
    data: dict[str, Any] = {
        "tier": {"root_dir": str(root)},
        "model": {
            "name": "acme/llama-tiny",
            "dtype": "float16",
            "groups": groups
            or [{"kind": "full_attention", "block_size": 16, "num_layers": 2, "num_kv_heads": 8, "head_size": 64}],
        },
        "parallel": {},
    }
    for section, values in over.items():
        data[section] = {**data.get(section, {}), **values}
    return parse_config(data)


@pytest.fixture
def cfg_factory(tmp_path: Path):
    def factory(**kw: Any) -> FstierConfig:
        root = kw.pop("root", tmp_path / "root")
        return make_config(root, **kw)

    return factory


@pytest.fixture(params=["on", "off"])
def io(request: pytest.FixtureRequest) -> str:
    """Both of fstier's I/O paths, as an adapter's ``native_io`` option (the
    LMCache tests): the native extension, then the Python path
    (``FSTIER_NATIVE=0`` forces the Python path: "on" skips there). Here and
    not in ``tests/lmcache/conftest.py``: a second ``conftest`` module would
    shadow this one for ``from conftest import ...`` (pytest's prepend import
    mode names both ``conftest``)."""
    from fstier.io import native

    if request.param == "on":
        if os.environ.get("FSTIER_NATIVE") == "0":
            pytest.skip("FSTIER_NATIVE=0 forces the Python I/O path")
        try:
            native.native_backend()
        except ConfigError:
            if os.environ.get("FSTIER_NATIVE") == "1":
                raise
            pytest.skip("native extension not built")
    return str(request.param)
