"""docs/integration.md: every Python snippet runs as written (in a fresh
interpreter, as a reader would paste it) and prints what the text says; the
vLLM config entry is valid JSON naming the tier the integration module
provides."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "integration.md"
TEXT = DOC.read_text()
SNIPPETS = re.findall(r"```python\n(.*?)```", TEXT, re.S)
EXPECTED = [
    ["stored 6 blocks at tp=2", "loaded 6 blocks at tp=4, byte for byte what tp=2 computed"],
    ["per-layer registration round-trips"],
    ["skip and file counts as described"],
]


def test_every_snippet_is_checked() -> None:
    assert len(SNIPPETS) == len(EXPECTED)


@pytest.mark.parametrize("idx", range(len(EXPECTED)))
def test_snippet_runs(idx: int, tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", SNIPPETS[idx]], capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "TMPDIR": str(tmp_path), "HOME": str(tmp_path)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    for line in EXPECTED[idx]:
        assert line in out.stdout, out.stdout
        if idx == 0:
            assert line in " ".join(TEXT.split())  # the text quotes what it prints


def test_staging_path_names_every_piece_in_order() -> None:
    order = [
        "CanonicalKVCaches",
        "allocate_cross_layer_kv_caches",
        "rank_page_mapping",
        "RankStager",
        "HostBlockPool",
        "FsTier",
    ]
    assert all(name in TEXT for name in order)
    for name in ("LoadStoreSpec", "block_indices", "group_sizes", "blocks_per_file", "skip"):
        assert name in TEXT


def test_vllm_entry_is_valid_and_linked(tmp_path: Path) -> None:
    block = re.search(r"```json\n(.*?)```", TEXT, re.S)
    assert block is not None
    doc = json.loads(block.group(1))
    # vLLM refuses to start without these (the snippet once lacked them).
    assert doc["kv_connector"] == "OffloadingConnector" and doc["kv_role"] == "kv_both"
    extra = doc["kv_connector_extra_config"]
    assert extra["spec_name"] == "TieringOffloadingSpec" and extra["cpu_bytes_to_use"] > 0
    tier = extra["secondary_tiers"][0]
    assert tier["type"] == "FstierTier" and tier["module_path"] == "fstier.integrations.vllm" and tier["root_dir"]
    assert "(vllm.md)" in TEXT
    # fstier's own check of the whole --kv-transfer-config, on a real root.
    tier["root_dir"] = str(tmp_path / "kv")
    (tmp_path / "kv.json").write_text(json.dumps(doc))
    out = subprocess.run(
        [sys.executable, "-m", "fstier.cli", "config", "validate", str(tmp_path / "kv.json"), "--check-root"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "fstier config validate kv.json --check-root" in TEXT


def test_readme_and_architecture_link_the_guide() -> None:
    for doc in (REPO / "README.md", REPO / "docs" / "architecture.md"):
        assert "integration.md" in doc.read_text(), doc


def test_staging_snippet_on_cuda(tmp_path: Path) -> None:
    """The text says CPU tensors stand in for GPU ones: on a machine with a
    GPU, the same snippet with its KV caches on CUDA loads the same bytes."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    code = SNIPPETS[0]
    assert "dtype=cfg.model.dtype)" in code and ".half()" in code
    code = code.replace("dtype=cfg.model.dtype)", 'dtype=cfg.model.dtype, device="cuda")').replace(
        ".half()", ".half().cuda()"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp_path)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert EXPECTED[0][1] in out.stdout
