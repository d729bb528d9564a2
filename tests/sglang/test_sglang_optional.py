"""The SGLang integration without SGLang: importing fstier never imports it,
and a missing or unsupported SGLang is one clear message."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fstier.errors import ConfigError
from fstier.integrations import sglang as sgl_mod


def test_importing_fstier_never_imports_sglang() -> None:
    code = (
        "import sys, fstier, fstier.integrations, fstier.cli; "
        "print('sglang' in sys.modules or any(m.startswith('sglang.') for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(
    ("installed", "says"),
    [(None, "SGLang is not installed"), ("0.4.9", "SGLang 0.4.9 is installed"), ("0.6.0", "SGLang 0.6.0 is installed")],
)
def test_a_missing_or_unsupported_sglang_is_one_clear_message(
    installed: str | None, says: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sgl_mod, "sglang_version", lambda: installed)
    with pytest.raises(sgl_mod.SglangUnavailableError, match=says) as err:
        sgl_mod.check_sglang()
    assert sgl_mod.SUPPORTED_SGLANG in str(err.value) and "docs/sglang.md" in str(err.value)
    if installed is None:
        with pytest.raises(sgl_mod.SglangUnavailableError, match=says):
            sgl_mod.FstierHiCacheStorage(None, {})


def test_options_outside_sglang_keys_are_checked_without_sglang(tmp_path) -> None:
    extra = {"backend_name": "fstier", "module_path": "m", "class_name": "C", "interface_v1": True}
    cfg = sgl_mod.tier_config_from_extra_config({**extra, "root_dir": str(tmp_path), "max_bytes": "1GiB"})
    assert cfg.max_bytes == 1 << 30
    with pytest.raises(ConfigError, match="'write_thread'.*unknown.*docs/sglang.md"):
        sgl_mod.tier_config_from_extra_config({**extra, "root_dir": str(tmp_path), "write_thread": 2})
    with pytest.raises(ConfigError, match="tier.read_threads"):
        sgl_mod.tier_config_from_extra_config({"root_dir": str(tmp_path), "read_threads": 0})
    with pytest.raises(ConfigError, match="JSON object"):
        sgl_mod.tier_config_from_extra_config(["root_dir"])  # type: ignore[arg-type]
