"""The operator's docs hold up (issue 22): docs/vllm.md's install, sizing and
vLLM JSON, and docs/deployment.md's Kubernetes example, checked against the
code that runs them -- the JSON is validated by ``fstier config validate``,
the initContainer's and the CronJob's commands run on a real root, the sizing
table is recomputed from its formula."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from fstier.cli import main
from fstier.units import parse_size

REPO = Path(__file__).resolve().parents[1]
VLLM_MD = (REPO / "docs" / "vllm.md").read_text()
DEPLOY_MD = (REPO / "docs" / "deployment.md").read_text()


def run(*args: str, stdin: str | None = None) -> Any:
    return CliRunner().invoke(main, list(args), input=stdin)


def _section(text: str, title: str) -> str:
    start = text.index(f"## {title}")
    nxt = text.find("\n## ", start + 3)
    return text[start : nxt if nxt != -1 else len(text)]


# -- docs/vllm.md ----------------------------------------------------------------
def test_no_doc_installs_fstier_from_an_index() -> None:
    """There is no fstier on any index: a bare `pip install fstier` would
    install whatever someone registered under the name."""
    for doc in [REPO / "README.md", *(REPO / "docs").glob("*.md")]:
        for line in doc.read_text().splitlines():
            if re.search(r"pip install ['\"]?fstier(\[[^\]]*\])?['\"]?(\s|$)(?!\s*@)", line):
                assert "would" in line or "not published" in line, f"{doc.name}: {line}"
    install = _section(VLLM_MD, "Installing into vLLM's environment")
    assert "pip wheel --no-deps -w dist ." in install and "pip install dist/fstier-0.1.0-py3-none-any.whl" in install


def _serve_json() -> dict[str, Any]:
    m = re.search(r"--kv-transfer-config '(\{.*?\})'", VLLM_MD, re.S)
    assert m is not None
    return json.loads(m.group(1))


def test_vllm_serve_json_validates(tmp_path: Path) -> None:
    doc = _serve_json()
    assert doc["kv_connector"] == "OffloadingConnector" and doc["kv_role"] == "kv_both"
    entry = doc["kv_connector_extra_config"]["secondary_tiers"][0]
    entry["root_dir"] = str(tmp_path / "kv")
    res = run("config", "validate", "-", "--check-root", stdin=json.dumps(doc))
    # 2 TiB may exceed this machine's disk: the space check may fail, nothing else.
    assert res.exit_code in (0, 1), res.output
    assert res.output.startswith(f"-: ok (FstierTier root_dir {tmp_path / 'kv'}, max_bytes 2.0 TiB)")
    for name in ("create", "write", "owner"):
        assert re.search(rf"^  ok   {name}", res.output, re.M), res.output
    shown = _section(VLLM_MD, "Switching it on")
    assert (
        "fstier config validate - --check-root" in shown
        and "-: ok (FstierTier root_dir /mnt/kv, max_bytes 2.0 TiB)" in shown
    )


_MODEL = re.compile(r"(\d+) layers, (\d+) KV heads x (\d+), (fp16|bf16)")


def test_sizing_table_follows_its_formula() -> None:
    sizing = _section(VLLM_MD, "Sizing")
    rows = [ln for ln in sizing.splitlines() if ln.startswith("| ") and "---" not in ln][1:]
    assert len(rows) >= 5
    last = None
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        m = _MODEL.search(cells[0])
        shape = (int(m[1]), int(m[2]), int(m[3]), 2) if m else last
        assert shape is not None, row
        last = shape
        layers, heads, head_size, dtype_bytes = shape
        per_token = 2 * layers * heads * head_size * dtype_bytes
        block, bpc = int(cells[1]), int(cells[2])
        row_bytes = bpc * block * per_token
        assert parse_size(cells[3].replace(" ", "")) == row_bytes, row
        tokens = int(cells[5])
        assert tokens == bpc * block, row
        per_tib = round(2**40 / (row_bytes + 4096) / 1000)
        assert cells[6] == f"{per_tib:,} k", (row, per_tib)


# -- docs/deployment.md: the Kubernetes example ------------------------------------
def _k8s() -> dict[str, dict[str, Any]]:
    block = re.search(r"## Kubernetes.*?```yaml\n(.*?)```", DEPLOY_MD, re.S)
    assert block is not None
    return {d["kind"]: d for d in yaml.safe_load_all(block.group(1))}


def test_kubernetes_example_is_a_vllm_deployment() -> None:
    docs = _k8s()
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    (engine,) = pod["containers"]
    script = " ".join(engine["command"] + engine["args"])
    assert "vllm serve" in script and "--kv-transfer-config" in script
    config_file = re.search(r"\$\(cat (\S+)\)", script)
    assert config_file is not None
    mounts = {m["name"]: m["mountPath"] for m in engine["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    cm_volume = next(n for n, v in volumes.items() if "configMap" in v)
    key = Path(config_file.group(1)).relative_to(mounts[cm_volume]).as_posix()
    kv = json.loads(docs["ConfigMap"]["data"][key])
    extra = kv["kv_connector_extra_config"]
    # /dev/shm holds vLLM's CPU tier: at least cpu_bytes_to_use.
    assert mounts["dshm"] == "/dev/shm"
    assert parse_size(volumes["dshm"]["emptyDir"]["sizeLimit"]) >= extra["cpu_bytes_to_use"]
    assert {"name": "PYTHONHASHSEED", "value": "0"} in engine["env"]
    # The initContainer checks the very file vllm serve reads, with --check-root.
    (init,) = pod["initContainers"]
    assert init["command"][:3] == ["fstier", "config", "validate"] and "--check-root" in init["command"]
    assert config_file.group(1) in init["command"]
    # No fstier model:/parallel: sections vLLM would ignore.
    assert "model:" not in json.dumps(docs["ConfigMap"]) and "parallel:" not in json.dumps(docs["ConfigMap"])


def test_gc_cronjob_runs_as_the_engines_uid_without_torch() -> None:
    docs = _k8s()
    engine_sc = docs["Deployment"]["spec"]["template"]["spec"]["securityContext"]
    job = docs["CronJob"]["spec"]["jobTemplate"]["spec"]
    sc = job["template"]["spec"]["securityContext"]
    for k in ("runAsUser", "runAsGroup", "fsGroup"):
        assert sc[k] == engine_sc[k], k
    assert job["backoffLimit"] <= 3
    (gc,) = job["template"]["spec"]["containers"]
    assert gc["image"] != docs["Deployment"]["spec"]["template"]["spec"]["containers"][0]["image"]
    assert "no torch" in gc["image"] or "no torch" in DEPLOY_MD


def test_kubernetes_commands_run_on_a_real_root(tmp_path: Path) -> None:
    """The initContainer's check and the CronJob's gc, with /kvcache and
    /etc/vllm pointed at temporary directories."""
    docs = _k8s()
    root = tmp_path / "kvcache"
    etc = tmp_path / "etc"
    etc.mkdir()
    for name, text in docs["ConfigMap"]["data"].items():
        (etc / name).write_text(text.replace("/kvcache", str(root)))
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    argv = [a.replace("/etc/vllm", str(etc)) for a in init["command"][1:]]
    res = run(*argv)
    assert res.exit_code == 0, res.output
    assert "ok   write" in res.output and "ok   owner" in res.output
    (gc,) = docs["CronJob"]["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    argv = [a.replace("/kvcache", str(root)) for a in gc["command"][1:]]
    res = run(*argv)
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["ok"] is True


@pytest.mark.parametrize("doc", ["vllm.md", "deployment.md"])
def test_console_commands_parse(doc: str) -> None:
    """Every `$ fstier ...` line in the operator docs is a command the CLI
    accepts (its --help exits 0 with the same subcommand path and options)."""
    text = (REPO / "docs" / doc).read_text()
    for line in re.findall(r"^\$ (?:.*\| )?(fstier [^#\n]+)", text, re.M):
        argv = shlex.split(line)[1:]
        words = [a for a in argv if not a.startswith("-")][:2]
        sub = words[:2] if words and words[0] == "config" else words[:1]
        res = run(*sub, "--help")
        assert res.exit_code == 0, (line, res.output)
        for opt in (a.split("=")[0] for a in argv if a.startswith("--")):
            assert opt in res.output, (line, opt)
