"""Config validation: every malformed input is one ConfigError line naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from fstier.config import load_config, parse_config
from fstier.errors import ConfigError
from fstier.units import parse_size

GOOD_YAML = """
tier:
  root_dir: {root}
  max_bytes: 2GiB
  file_mode: "0640"
model:
  name: acme/llama
  revision: abc123
  dtype: bf16
  groups:
    - kind: full_attention
      block_size: 16
      num_layers: 4
      num_kv_heads: 8
      head_size: 128
parallel:
  tp_size: 2
  rank: 1
"""


def test_good_yaml_loads_with_units_and_aliases(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text(GOOD_YAML.format(root=tmp_path / "root"))
    cfg = load_config(p)
    assert cfg.tier.max_bytes == 2 * 1024**3
    assert cfg.tier.file_mode == 0o640
    assert cfg.model.dtype == "bfloat16"
    assert cfg.model.groups[0].dtype == "bfloat16"  # inherited from the model
    assert cfg.model.groups[0].page_bytes == 4 * 2 * 16 * 8 * 128 * 2
    assert cfg.parallel.tp_rank == 1 and cfg.parallel.world_size == 2


@pytest.mark.parametrize(
    ("value", "expected"),
    [(0, 0), (4096, 4096), ("4096", 4096), ("512MiB", 512 * 1024**2), ("2TB", 2 * 10**12),
     ("1.5GiB", 3 * 1024**3 // 2), ("10 kB", 10_000), ("3KiB", 3072)],
)
def test_parse_size(value: object, expected: int) -> None:
    assert parse_size(value) == expected


BASE = {
    "tier": {"root_dir": "/tmp/fstier-test-root"},
    "model": {"name": "m", "groups": [{"num_kv_heads": 8, "head_size": 64}]},
}


def _with(section: str, **values: object) -> dict:
    data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in BASE.items()}
    data[section] = {**data.get(section, {}), **values}
    return data


def _group(**values: object) -> dict:
    g = {"num_kv_heads": 8, "head_size": 64, **values}
    return {"tier": BASE["tier"], "model": {"name": "m", "groups": [g]}}


MALFORMED: list[tuple[str, dict, list[str]]] = [
    ("read_threads zero", _with("tier", read_threads=0), ["tier.read_threads", ">= 1", "got 0"]),
    ("write_threads negative", _with("tier", write_threads=-2), ["tier.write_threads", "got -2"]),
    ("negative size", _with("tier", max_bytes=-5), ["tier.max_bytes", "-5"]),
    ("negative size string", _with("tier", max_bytes="-5GB"), ["tier.max_bytes", "-5GB"]),
    ("bad unit", _with("tier", max_bytes="12 parsecs"), ["tier.max_bytes", "parsecs"]),
    ("size wrong type", _with("tier", max_bytes=[1]), ["tier.max_bytes"]),
    ("o_direct bad", _with("tier", o_direct="maybe"), ["tier.o_direct", "maybe"]),
    ("checksum bad", _with("tier", checksum="md5"), ["tier.checksum", "md5"]),
    ("fsync bad", _with("tier", fsync="always"), ["tier.fsync", "always"]),
    ("file_mode bad", _with("tier", file_mode="rwx"), ["tier.file_mode", "rwx"]),
    ("file_mode too big", _with("tier", file_mode=0o7777), ["tier.file_mode"]),
    ("watermarks inverted", _with("tier", low_watermark=0.9, high_watermark=0.5), ["low_watermark", "high_watermark"]),
    ("unknown tier key", _with("tier", read_thread=4), ["tier.read_thread", "unknown key"]),
    ("unknown top key", {**BASE, "tiers": {}}, ["tiers", "unknown key"]),
    ("missing root", {"tier": {}, "model": BASE["model"]}, ["tier.root_dir", "missing"]),
    ("empty root", _with("tier", root_dir=""), ["tier.root_dir"]),
    ("missing model", {"tier": BASE["tier"]}, ["model", "missing"]),
    ("no groups", {"tier": BASE["tier"], "model": {"name": "m", "groups": []}}, ["model.groups"]),
    ("bad dtype", _with("model", dtype="float13"), ["model.dtype", "float13"]),
    ("bad kind", _group(kind="linear_attention"), ["model.groups.0.kind", "linear_attention"]),
    ("block_size string", _group(block_size="sixteen"), ["model.groups.0.block_size", "sixteen"]),
    ("block_size zero", _group(block_size=0), ["model.groups.0.block_size", "got 0"]),
    ("sliding window missing", _group(kind="sliding_window"), ["model.groups.0", "sliding_window"]),
    ("mamba without page", _group(kind="mamba"), ["model.groups.0", "page_size_bytes"]),
    ("mla with heads", _group(kind="mla", num_kv_heads=8), ["model.groups.0", "num_kv_heads"]),
    ("bad kv_layout", _group(kv_layout="THD"), ["model.groups.0.kv_layout", "THD"]),
    ("rank too big", _with("parallel", tp_size=2, rank=2), ["parallel", "rank", "got 2"]),
    ("dcp does not divide tp", _with("parallel", tp_size=4, dcp_size=3), ["parallel", "dcp_size"]),
    ("bad runner", _with("parallel", model_runner="v3"), ["parallel.model_runner", "v3"]),
    ("tp bool-ish string", _with("parallel", tp_size="two"), ["parallel.tp_size", "two"]),
]


@pytest.mark.parametrize(("label", "data", "words"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_config_is_one_line_naming_the_field(label: str, data: dict, words: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    msg = str(info.value)
    assert "\n" not in msg
    for word in words:
        assert word in msg, f"{label}: {word!r} not in {msg!r}"


def test_root_dir_that_is_a_file(tmp_path: Path) -> None:
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(ConfigError, match=r"tier\.root_dir: .*is a file"):
        parse_config(_with("tier", root_dir=str(f)))


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("tier: [unclosed", ["invalid YAML", "line"]),
        ("- just\n- a list\n", ["top level must be a mapping"]),
        ("", ["top level must be a mapping"]),
        ("tier:\n  root_dir: /x\n model: 3\n", ["invalid YAML"]),
    ],
)
def test_bad_yaml_files(tmp_path: Path, text: str, words: list[str]) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(p)
    assert "\n" not in str(info.value)
    for w in words:
        assert w in str(info.value)


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")


def test_yaml_is_safe_loaded(tmp_path: Path) -> None:
    p = tmp_path / "evil.yaml"
    p.write_text("tier: !!python/object/apply:os.system ['true']\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(p)


def test_config_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        parse_config(_with("tier", read_threads=0))


# -- non-finite and out-of-range numbers (issue 15 item 5) ---------------------
_FLOAT_FIELDS = [
    "low_watermark",
    "high_watermark",
    "max_write_queue_seconds",
    "io_timeout_s",
    "lookup_cache_ttl_s",
    "temp_max_age_s",
    "breaker_cooldown_s",
]


def _tier_with(tmp_path: Path, **tier: object) -> dict[str, object]:
    return {
        "tier": {"root_dir": str(tmp_path / "root"), **tier},
        "model": {"name": "m", "groups": [{"head_size": 8}]},
    }


@pytest.mark.parametrize("field", _FLOAT_FIELDS)
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan"), "inf", "1e400", "nan"])
def test_every_float_option_must_be_finite(tmp_path: Path, field: str, value: object) -> None:
    """inf in temp_max_age_s silently disabled eviction (OverflowError in
    every capacity pass); inf in io_timeout_s killed the watchdog thread."""
    with pytest.raises(ConfigError, match=rf"^tier\.{field}: must be (a finite number|<|>)"):
        parse_config(_tier_with(tmp_path, **{field: value}))


@pytest.mark.parametrize(
    ("field", "value", "bound"),
    [
        ("io_timeout_s", 1e300, "<= 86400"),
        ("lookup_cache_ttl_s", 86401, "<= 86400"),
        ("breaker_cooldown_s", 1e12, "<= 86400"),
        ("max_write_queue_seconds", 3601, "<= 3600"),
        ("temp_max_age_s", 1e18, "<= 31536000"),
    ],
)
def test_time_options_have_an_upper_bound(tmp_path: Path, field: str, value: float, bound: str) -> None:
    with pytest.raises(ConfigError, match=rf"tier\.{field}: must be {bound}, got"):
        parse_config(_tier_with(tmp_path, **{field: value}))


def test_yaml_infinity_is_refused_by_name(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text(
        f"tier:\n  root_dir: {tmp_path / 'root'}\n  temp_max_age_s: .inf\n"
        "model:\n  name: m\n  groups: [{head_size: 8}]\n"
    )
    with pytest.raises(ConfigError, match=r"tier\.temp_max_age_s: must be a finite number, got inf"):
        load_config(p)


@pytest.mark.parametrize("value", [float("inf"), float("nan"), 1e300, "9" * 400, "99999999999999999999TiB"])
def test_sizes_must_be_finite_and_fit_a_file_offset(tmp_path: Path, value: object) -> None:
    """max_bytes: .inf was an OverflowError traceback, not a ConfigError."""
    with pytest.raises(ConfigError, match=r"^tier\.max_bytes: .*(whole number|at most \d+ bytes)"):
        parse_config(_tier_with(tmp_path, max_bytes=value))
    with pytest.raises(ValueError):
        parse_size(value)
