"""The tier and the operator's commands run where torch cannot be imported
(docs/deployment.md: the gc CronJob's image needs no torch). Only the
engine-side staging (layout, gpu_copy: pinning and slot tensors) and
``fstier demo`` need it, and the demo says so in one line.

Real processes, a real root: a ``sitecustomize`` makes every ``import torch``
fail in the child processes, which then store and load blocks with FsTier
over plain rows (RowSlots on a bytearray) and run ``config validate
--check-root``, ``inspect``, ``verify``, ``gc`` and ``--help``;
``FsTier.from_config`` (its own shared-memory HostBlockPool) and ``fstier
config validate`` of a vLLM document load neither torch nor an engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FSTIER = [sys.executable, "-m", "fstier.cli"]

BLOCKER = '''
import sys
class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by test_torch_free)", name=name)
        return None
sys.meta_path.insert(0, _NoTorch())
'''

STORE_AND_LOAD = r'''
import sys
from pathlib import Path
from fstier import FsTier, load_config
from fstier.slots import RowSlots
from fstier.keys import BlockKey

cfg = load_config(sys.argv[1])
rows = RowSlots(memoryview(bytearray(8 * 8192)), 8, 8192)
tier = FsTier(cfg, rows)
keys = [BlockKey(bytes([i]) * 16, 0) for i in range(4)]
n = tier.payload_bytes(keys[0])
for i in range(4):
    rows.slot_view(i)[:n] = bytes([i + 1]) * n
tier.submit_store("s", keys, [0, 1, 2, 3]); tier.drain()
assert all(r.success for r in tier.get_finished())
tier.submit_load("l", keys, [4, 5, 6, 7]); tier.drain()
(res,) = tier.get_finished()
assert res.success and bytes(rows.slot_view(6)[:n]) == bytes([3]) * n
tier.close()
assert "torch" not in sys.modules
print("stored and loaded 4 blocks without torch")
'''


#: FsTier.from_config with its private HostBlockPool, then `fstier config
#: validate` of a vLLM --kv-transfer-config, in one process: neither loads
#: torch (blocked) nor vLLM/SGLang (installed, so only sys.modules can tell).
FROM_CONFIG_AND_VALIDATE = r'''
import sys
from fstier import FsTier
from fstier.cli import main
from fstier.keys import BlockKey
from fstier.slots.host_pool import HostBlockPool

tier = FsTier.from_config(sys.argv[1])
assert isinstance(tier.pool, HostBlockPool)
keys = [BlockKey(bytes([i]) * 16, 0) for i in range(2)]
slots = tier.pool.alloc(4)
n = tier.payload_bytes(keys[0])
tier.pool.slot_view(slots[1])[:n] = bytes([7]) * n
tier.submit_store("s", keys, slots[:2]); tier.drain()
assert all(r.success for r in tier.get_finished())
tier.submit_load("l", keys, slots[2:]); tier.drain()
(res,) = tier.get_finished()
assert res.success and bytes(tier.pool.slot_view(slots[3])[:n]) == bytes([7]) * n
tier.close()
try:
    main(["config", "validate", sys.argv[2]])
except SystemExit as exc:
    assert exc.code in (0, None), exc.code
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "vllm", "sglang"))
assert heavy == [], heavy
print("from_config and config validate without torch or an engine")
'''


def _env(tmp_path: Path) -> dict[str, str]:
    blocker = tmp_path / "blocker"
    blocker.mkdir(exist_ok=True)
    (blocker / "sitecustomize.py").write_text(BLOCKER)
    return {**os.environ, "PYTHONPATH": f"{blocker}{os.pathsep}{REPO}", "COLUMNS": "80"}


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*args], capture_output=True, text=True, timeout=180, env=_env(tmp_path), cwd=tmp_path)


def test_the_blocker_blocks(tmp_path: Path) -> None:
    proc = _run(tmp_path, sys.executable, "-c", "import torch")
    assert proc.returncode != 0 and "blocked by test_torch_free" in proc.stderr


def test_tier_and_operator_commands_run_without_torch(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        f"tier: {{root_dir: {root}, max_bytes: 1Mi, read_threads: 2, write_threads: 2}}\n"
        "model: {name: acme/m, groups: [{block_size: 4, num_kv_heads: 1, head_size: 8}]}\n"
    )
    proc = _run(tmp_path, sys.executable, "-c", STORE_AND_LOAD, str(cfg))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "stored and loaded 4 blocks without torch" in proc.stdout
    for argv in (["--help"], ["config", "validate", str(cfg), "--check-root"], ["config", "show", str(cfg)],
                 ["inspect", str(root)], ["verify", str(root)], ["gc", str(root), "--max-bytes", "8KiB"]):
        res = _run(tmp_path, *FSTIER, *argv)
        assert res.returncode == 0, (argv, res.stderr[-2000:])
    doc = json.loads(_run(tmp_path, *FSTIER, "inspect", str(root), "--json").stdout)
    assert doc["total_files"] == 1  # gc kept one 8 KiB file


def test_from_config_and_vllm_config_validate_load_neither_torch_nor_vllm(tmp_path: Path) -> None:
    """FsTier.from_config used to import torch through its private pool (it
    pinned memory and made slot tensors), and ``config validate`` imported
    vLLM to check FstierTier's options."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        f"tier: {{root_dir: {tmp_path / 'kv'}, read_threads: 1, write_threads: 1}}\n"
        "model: {name: acme/m, groups: [{block_size: 4, num_kv_heads: 1, head_size: 8}]}\n"
    )
    kv = tmp_path / "kv.json"
    kv.write_text(json.dumps({
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 30, "secondary_tiers": [
            {"type": "FstierTier", "module_path": "fstier.integrations.vllm", "root_dir": str(tmp_path / "v"),
             "max_bytes": "1G", "n_read_threads": 2}]},
    }))
    proc = _run(tmp_path, sys.executable, "-c", FROM_CONFIG_AND_VALIDATE, str(cfg), str(kv))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "from_config and config validate without torch or an engine" in proc.stdout, proc.stdout


def test_demo_without_torch_says_what_to_install(tmp_path: Path) -> None:
    res = _run(tmp_path, *FSTIER, "demo")
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs torch" in lines[0] and "torch extra" in lines[0], res.stderr
