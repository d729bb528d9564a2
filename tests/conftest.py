"""Shared fixtures: small model/tier configs built on real tmp_path roots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fstier.config import FstierConfig, parse_config


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
