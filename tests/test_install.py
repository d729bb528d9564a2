"""The install path into vLLM's environment (docs/vllm.md "Installing into
vLLM's environment"), as an operator runs it: build a wheel of fstier from
the sources, install it into a fresh virtual environment that sees this
environment's packages (vLLM, torch and their dependencies: "beside vLLM"),
and run fstier from that environment, not from the source tree.

Cheap by construction (~15 s): the wheel is built without build isolation,
the venv is made without pip (this environment's pip runs in it), the
install is ``--no-deps --no-index`` (every dependency is already beside it),
and torch is the local wheel already installed. What it proves:

- the wheel holds the whole package (CLI, vLLM integration, py.typed) and
  its console script;
- every requirement fstier declares is satisfied by the versions installed
  beside vLLM, and where vLLM declares the same package both agree
  (fstier's pins never force a version vLLM refuses);
- vLLM's real factory loads ``FstierTier`` from the installed wheel and a
  restart hits what the first manager stored (examples/vllm_tier.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _build_wheel(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    shutil.copytree(REPO / "fstier", src / "fstier", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    dist = tmp_path / "dist"
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet"]
    proc = subprocess.run([*pip_wheel, "-w", str(dist), str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    wheels = list(dist.glob("fstier-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def _venv_beside_this_one(tmp_path: Path) -> tuple[Path, Path]:
    env = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True, timeout=120)
    py = env / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # After the new venv's own site-packages: vLLM, torch and every
    # dependency of this environment (a .pth line is a plain path entry, so
    # this environment's editable fstier finder is not activated there).
    Path(site, "beside-vllm.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return env, py


def _env(tmp_path: Path) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "TMPDIR": str(tmp_path), "PYTHONNOUSERSITE": "1"}


def test_wheel_installs_and_runs_beside_vllm(tmp_path: Path) -> None:
    wheel = _build_wheel(tmp_path)
    names = set(subprocess.run([sys.executable, "-m", "zipfile", "-l", str(wheel)], capture_output=True,
                               text=True, check=True).stdout.split())
    expected = ("fstier/integrations/vllm.py", "fstier/cli/__init__.py", "fstier/py.typed", "fstier/io/blockstore.py")
    for member in expected:
        assert member in names, f"{member} missing from {wheel.name}"
    env, py = _venv_beside_this_one(tmp_path)
    proc = subprocess.run([str(py), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", str(wheel)],
                          capture_output=True, text=True, timeout=300, env=_env(tmp_path), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]

    # fstier now comes from the wheel in the new venv, not from the sources.
    probe = subprocess.run(
        [str(py), "-c", _PINS_PROBE], capture_output=True, text=True, timeout=120, env=_env(tmp_path), cwd=tmp_path,
    )
    assert probe.returncode == 0, probe.stderr[-3000:]
    report = json.loads(probe.stdout)
    assert report["file"].startswith(str(env)), report["file"]
    assert report["unsatisfied"] == [], f"fstier's requirements not met beside vLLM: {report['unsatisfied']}"
    assert report["disagree"] == [], f"fstier and vLLM disagree on: {report['disagree']}"

    version = subprocess.run([str(env / "bin" / "fstier"), "--version"], capture_output=True, text=True,
                             timeout=60, env=_env(tmp_path), cwd=tmp_path)
    assert version.returncode == 0 and "0.1.0" in version.stdout, version.stderr

    if not report["vllm"]:
        if os.environ.get("FSTIER_REQUIRE_VLLM") == "1":
            pytest.fail("vLLM is not installed beside fstier but FSTIER_REQUIRE_VLLM=1")
        pytest.skip("vLLM is not installed: the wheel installs, the vLLM run is skipped")
    run = subprocess.run([str(py), str(REPO / "examples" / "vllm_tier.py")], capture_output=True, text=True,
                         timeout=300, env=_env(tmp_path), cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "4. hit: 8 of 8 chunks HIT; rows match the stored bytes" in run.stdout, run.stdout


#: Run in the new venv: where fstier comes from, and whether the versions
#: installed beside vLLM satisfy fstier's requirements and vLLM's for the
#: same packages.
_PINS_PROBE = r"""
import importlib.metadata as md, json, fstier
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

def installed(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None

def base_reqs(dist):
    out = {}
    for text in md.requires(dist) or []:
        r = Requirement(text)
        # The base requirements and the metrics extra (what a vLLM image
        # installs with the metrics extra).
        if r.marker is not None and not any(r.marker.evaluate({"extra": e}) for e in ("", "metrics")):
            continue
        out[canonicalize_name(r.name)] = r
    return out

ours = base_reqs("fstier")
unsatisfied = [f"{r} (installed {installed(n)})" for n, r in ours.items()
               if installed(n) is None or not r.specifier.contains(installed(n), prereleases=True)]
disagree = []
has_vllm = installed("vllm") is not None
if has_vllm:
    theirs = base_reqs("vllm")
    for n, r in ours.items():
        v = installed(n)
        if n in theirs and v is not None and not theirs[n].specifier.contains(v, prereleases=True):
            disagree.append(f"{n}: fstier {r.specifier or 'any'}, vLLM {theirs[n].specifier}, installed {v}")
print(json.dumps({"file": fstier.__file__, "unsatisfied": unsatisfied, "disagree": disagree, "vllm": has_vllm}))
"""


QUIET_METADATA = r'''
import sys, warnings
import setuptools.build_meta as backend
meta_dir = sys.argv[1]  # the backend rewrites sys.argv for setup.py
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    out = backend.prepare_metadata_for_build_wheel(meta_dir)
for w in caught:
    if issubclass(w.category, DeprecationWarning) or "Deprecation" in w.category.__name__:
        print("DEPRECATED", w.category.__name__, str(w.message).splitlines()[0])
with open(f"{meta_dir}/{out}/METADATA") as f:
    print("META", f.read().count("License-Expression: Apache-2.0"))
'''


def test_the_build_backend_prints_no_deprecation_of_ours(tmp_path: Path) -> None:
    """``make demo`` on a fresh machine printed setuptools' ``project.license``
    deprecation box four times (the TOML-table form); the SPDX string is
    read as the license expression and nothing is deprecated."""
    src = tmp_path / "src"
    (src / "fstier").mkdir(parents=True)
    for name in ("pyproject.toml", "README.md", "setup.py"):
        shutil.copy(REPO / name, src / name)
    shutil.copy(REPO / "fstier" / "__init__.py", src / "fstier" / "__init__.py")
    proc = subprocess.run(
        [sys.executable, "-c", QUIET_METADATA, str(tmp_path)], capture_output=True, text=True, cwd=src, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "DEPRECATED" not in proc.stdout, proc.stdout
    assert "META 1" in proc.stdout, proc.stdout
