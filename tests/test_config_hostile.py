"""Hostile config files: whatever the file is, every reader (``load_config``,
``fstier config validate|show``, an engine's ``config`` option) answers with
one ConfigError line, exit 2 from the CLI, in bounded time and memory
(fstier/config_file.py). Each case here used to hang, read until
MemoryError, or end in a RecursionError or ValueError traceback, or echo a
megabyte back."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from fstier.config import load_config
from fstier.config_file import MAX_CONFIG_BYTES, MAX_CONFIG_DEPTH, MAX_INT_DIGITS
from fstier.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
#: No error line may be longer than this (values are cut to 80 characters).
MAX_LINE = 600

GOOD = "tier:\n  root_dir: {root}\nmodel:\n  name: m\n  groups:\n    - head_size: 8\n"


def _fifo(d: Path) -> Path:
    p = d / "fifo.yaml"
    os.mkfifo(p)
    return p


def _socket(d: Path) -> Path:
    p = d / "sock.yaml"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(p))  # the socket file stays after close
    s.close()
    return p


def _write(name: str, text: str) -> Callable[[Path], Path]:
    def make(d: Path) -> Path:
        p = d / name
        p.write_text(text.replace("{root}", str(d / "root")))
        return p

    return make


def _nested_block(depth: int) -> str:
    return "".join("  " * i + f"k{i}:\n" for i in range(depth)) + "  " * depth + "v: 1\n"


BIG = "x" * 2_000_000  # over the file size cap
LONG = "x" * 900_000  # under it, over the string limit

#: (id, how to make the file, a piece of the expected message)
CASES: list[tuple[str, Callable[[Path], Path], str]] = [
    ("fifo", _fifo, "not a regular file (a FIFO)"),
    ("dev-zero", lambda _d: Path("/dev/zero"), "not a regular file (a device)"),
    ("socket", _socket, "not a regular file"),
    ("directory", lambda d: d, "is a directory"),
    ("yaml-flow-500-deep", _write("flow.yaml", "tier: " + "[" * 500 + "]" * 500), "nested deeper than"),
    ("yaml-block-500-deep", _write("block.yaml", _nested_block(500)), "nested deeper than"),
    ("json-600-deep", _write("deep.json", "[" * 600 + "]" * 600), "nested deeper than"),
    # libyaml says "maximum nesting depth"
    ("json-100k-deep", _write("deeper.json", "[" * 100_000 + "]" * 100_000), "nest"),
    (
        "yaml-int-5000-digits",
        _write("int.yaml", GOOD + "parallel:\n  rank: " + "9" * 5000 + "\n"),
        "an integer of 5,000 digits",
    ),
    (
        "yaml-tagged-int",
        _write("tag.yaml", GOOD + "parallel:\n  rank: !!int '" + "9" * 5000 + "'\n"),
        "an integer of 5,000 digits",
    ),
    (
        "json-int-5000-digits",
        _write("int.json", '{"type": "FstierTier", "root_dir": "/x", "max_bytes": ' + "9" * 5000 + "}"),
        "digits",
    ),
    ("yaml-bad-date", _write("date.yaml", GOOD + "parallel:\n  rank: 2020-13-45\n"), "invalid YAML value"),
    (
        "yaml-recursive-alias",
        _write("alias.yaml", "tier: &a\n  root_dir: /x\n  loop: [*a]\nmodel: {name: m}\n"),
        "nested deeper than",
    ),
    (
        "yaml-billion-laughs",
        _write(
            "laughs.yaml",
            "a: &a [x, x, x, x, x, x, x, x, x]\n"
            + "".join(
                f"{chr(98 + i)}: &{chr(98 + i)} [" + ", ".join([f"*{chr(97 + i)}"] * 9) + "]\n" for i in range(8)
            ),
        ),
        "more than 10,000 values",
    ),
    (
        "2MB-value",
        _write("salt.yaml", GOOD.replace("tier:\n", f"tier:\n  namespace_salt: {BIG}\n")),
        "bytes, more than",
    ),
    (
        "900KB-value",
        _write("salt.yaml", GOOD.replace("tier:\n", f"tier:\n  namespace_salt: {LONG}\n")),
        "tier.namespace_salt: a string of 900,000 characters",
    ),
    (
        "900KB-key",
        _write("key.yaml", GOOD.replace("tier:\n", f"tier:\n  ? {LONG}\n  : 1\n")),
        "tier: a key of 900,000 characters",
    ),
    ("over-size-cap", _write("big.yaml", "# " + "y" * (MAX_CONFIG_BYTES + 10) + "\n" + GOOD), "bytes, more than"),
    ("not-utf8", lambda d: (d / "bin.yaml", (d / "bin.yaml").write_bytes(b"tier: \xff\xfe\n"))[0], "not UTF-8"),
]


def _one_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    assert len(lines) == 1, text[:2000]
    assert len(lines[0]) <= MAX_LINE, lines[0][:2000]
    return lines[0]


@pytest.mark.parametrize(("make", "expect"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_load_config_refuses_hostile_files_in_one_line(
    tmp_path: Path, make: Callable[[Path], Path], expect: str
) -> None:
    path = make(tmp_path)
    # A child process: before the fix the FIFO hung forever and /dev/zero
    # read until MemoryError; the timeout and the memory limit bound both.
    code = textwrap.dedent(
        f"""
        import resource, sys
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
        from fstier.config import load_config
        from fstier.errors import ConfigError
        try:
            load_config({str(path)!r})
        except ConfigError as exc:
            print("ConfigError:", exc)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-3000:]
    line = _one_line(proc.stdout)
    assert line.startswith("ConfigError:") and expect in line, line


@pytest.mark.parametrize(("make", "expect"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
@pytest.mark.parametrize("command", ["validate", "show"])
def test_config_cli_refuses_hostile_files_exit_2_one_line(
    tmp_path: Path, make: Callable[[Path], Path], expect: str, command: str
) -> None:
    path = make(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "fstier.cli", "config", command, str(path)], capture_output=True, text=True,
        timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)}, stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr
    assert expect in _one_line(proc.stderr) or (expect == "is a directory" and "directory" in proc.stderr)


def test_stdin_is_read_up_to_the_cap(tmp_path: Path) -> None:
    """``-`` reads stdin, a pipe by nature; /dev/zero there is cut at the cap."""
    with open("/dev/zero", "rb") as zero:
        proc = subprocess.run(
            [sys.executable, "-m", "fstier.cli", "config", "validate", "-"], stdin=zero, capture_output=True,
            text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)},
        )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"more than {MAX_CONFIG_BYTES:,} bytes" in _one_line(proc.stderr)


def test_engine_config_option_refuses_a_fifo(tmp_path: Path) -> None:
    from fstier.integrations._options import tier_config_from_engine_options

    fifo = _fifo(tmp_path)
    with pytest.raises(ConfigError, match=r"option 'config'.*not a regular file \(a FIFO\)"):
        tier_config_from_engine_options(
            {"config": str(fifo)}, who="FstierTier", engine="vLLM", engine_keys=(), aliases={}, doc="docs/vllm.md"
        )


def test_the_limits_leave_real_configs_alone(tmp_path: Path) -> None:
    """A document at the limits still loads: depth 32 in an ignored section,
    an integer of MAX_INT_DIGITS digits is a field error, not a limit."""
    p = tmp_path / "c.yaml"
    p.write_text(GOOD.format(root=tmp_path / "root") + "parallel:\n  rank: 0\n")
    assert load_config(p).model.name == "m"
    p.write_text(GOOD.format(root=tmp_path / "root") + "parallel:\n  rank: " + "1" * MAX_INT_DIGITS + "\n")
    with pytest.raises(ConfigError, match="parallel: rank must be < world size"):
        load_config(p)
    deep = "[" * (MAX_CONFIG_DEPTH - 1) + "]" * (MAX_CONFIG_DEPTH - 1)
    p.write_text(GOOD.format(root=tmp_path / "root") + f"extra: {deep}\n")
    with pytest.raises(ConfigError, match="extra: unknown key"):
        load_config(p)


def test_a_long_value_is_cut_in_a_field_error(tmp_path: Path) -> None:
    """Under the string limit but over a field's own: the message shows 80
    characters of it and says how long it was."""
    p = tmp_path / "c.yaml"
    p.write_text(GOOD.format(root=tmp_path / "root").replace("name: m", "name: " + "n" * 4000))
    with pytest.raises(ConfigError) as err:
        load_config(p)
    msg = str(err.value)
    assert "model.name" in msg and "(4,000 characters)" in msg and len(msg) < MAX_LINE, msg


@pytest.mark.parametrize("field", ["namespace_salt", "root_dir", "o_direct", "file_mode", BIG])
def test_megabyte_values_from_an_engine_are_cut(field: str) -> None:
    """Options an engine hands over (parsed by the engine, never a file):
    a 2 MB value, or key, is shown as 80 characters and its length."""
    from fstier.integrations._options import tier_config_from_engine_options

    options = {"root_dir": "/tmp/fstier-x", field: BIG} if field != BIG else {"root_dir": "/tmp/x", BIG: 1}
    with pytest.raises(ConfigError) as err:
        tier_config_from_engine_options(
            options, who="FstierTier", engine="vLLM", engine_keys=(), aliases={}, doc="docs/vllm.md"
        )
    assert len(str(err.value)) < MAX_LINE, str(err.value)[:3000]
