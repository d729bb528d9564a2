"""The ``fstier`` command: a thin shell over the library.

Commands: ``demo`` (the end-to-end tour: tp=2 stores, tp=4 loads, every
fail-closed case), ``inspect`` (one row per namespace), ``verify`` (check
every block, ``--fix`` removes bad ones), ``gc`` (LRU eviction and temp sweep
with FsTier's own capacity code), ``bench`` (fstier vs raw O_DIRECT), and
``config validate|show``.

Conventions every command follows:

- exit 0 ok, 1 runtime failure (or something bad was found and not fixed),
  2 usage or configuration error with ONE line naming the field;
- ``--json`` prints one JSON document on stdout for scripts; people get rich
  tables and progress bars (progress goes to stderr, and only to a terminal);
- ``fstier --help`` never imports torch: torch-heavy modules (layout,
  gpu_copy, manager, the demo) are imported inside the commands that need
  them. ``tests/test_cli.py`` checks ``sys.modules`` in a real subprocess.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from fstier.errors import ConfigError, FstierError

F = TypeVar("F", bound=Callable[..., Any])

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2


# -- output helpers ----------------------------------------------------------
def _console(stderr: bool = False) -> Any:
    """A rich console bound to the *current* stdout/stderr (CliRunner swaps them).

    Off a terminal rich would wrap tables at 80 columns; 200 keeps the rows of
    ``inspect`` on one line in logs and in docs/cli.md.
    """
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() else 200
    return Console(file=stream, width=width, soft_wrap=False, highlight=False)


def _emit_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=False, default=str))


class _Fail(Exception):
    """Internal: stop a command with an exit code and one line."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _handle_errors(func: F) -> F:
    """Map exceptions to exit codes with one clear line (and a JSON error
    document when the command was asked for ``--json``)."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        as_json = bool(kwargs.get("as_json"))
        try:
            return func(*args, **kwargs)
        except _Fail as exc:
            code, message = exc.code, exc.message
        except ConfigError as exc:
            code, message = EXIT_USAGE, f"config error: {exc}"
        except FstierError as exc:
            code, message = EXIT_FAILURE, f"error: {exc}"
        except OSError as exc:
            where = f" {exc.filename}" if exc.filename else ""
            code, message = EXIT_FAILURE, f"error:{where}: {exc.strerror or exc}"
        if as_json:
            _emit_json({"ok": False, "exit_code": code, "error": message})
        click.echo(message, err=True)
        sys.exit(code)

    return wrapper  # type: ignore[return-value]


def _json_option(func: F) -> F:
    return click.option("--json", "as_json", is_flag=True, help="Print one JSON document for scripts.")(
        func
    )


def _existing_root(root: str) -> Path:
    p = Path(root)
    if not p.exists():
        raise _Fail(EXIT_USAGE, f"ROOT {root!r}: no such directory")
    if not p.is_dir():
        raise _Fail(EXIT_USAGE, f"ROOT {root!r}: not a directory")
    return p


def _fmt_time(ts: float | None) -> str:
    if ts is None:
        return "-"
    return time.strftime("%m-%d %H:%M:%S", time.localtime(ts))


def _fmt_size(n: float) -> str:
    from fstier._units import format_size

    return format_size(n)


def _parse_size_option(value: str, option: str) -> int:
    from fstier._units import parse_size

    try:
        return parse_size(value)
    except ValueError as exc:
        raise _Fail(EXIT_USAGE, f"{option}: {exc}") from None


# -- the group ---------------------------------------------------------------
@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="fstier")
def main() -> None:
    """fstier: a filesystem tier for LLM KV caches.

    \b
    Start with `fstier demo`: tp=2 ranks store a prompt's KV blocks, tp=4
    ranks load them back, and every case that must fail closed is shown.
    Exit codes: 0 ok, 1 failure, 2 usage or configuration error.
    """


# -- config ------------------------------------------------------------------
@main.group("config")
def config_group() -> None:
    """Validate or show a YAML configuration."""


def _load(path: str) -> Any:
    from fstier.config import load_config

    return load_config(path)


def resolved_config(cfg: Any) -> dict[str, Any]:
    """The config with every default filled in, plus what it maps to on disk."""
    from fstier._format import canonical_format_id, canonical_page_bytes, is_certified
    from fstier.file_mapper import FileMapper

    mapper = FileMapper(cfg)
    groups = []
    for idx, g in enumerate(cfg.model.groups):
        groups.append(
            {
                "group": idx,
                "kind": g.kind,
                "page_bytes": g.page_bytes,
                "file_page_bytes": canonical_page_bytes(g, cfg.parallel),
                "file_payload_bytes": mapper.expected_payload_bytes(idx),
                "format_id": canonical_format_id(g),
                "shared_across_ranks": is_certified(g, cfg.parallel),
            }
        )
    dumped = cfg.model_dump(mode="json")
    # Octal, as people write it (and as load_config accepts it back).
    dumped["tier"]["file_mode"] = f"{cfg.tier.file_mode:04o}"
    return {
        "config": dumped,
        "namespace": mapper.namespace,
        "namespace_dir": str(mapper.namespace_dir),
        "blocks_dir": str(mapper.blocks_dir),
        "digest": mapper.digest,
        "parallel_agnostic": mapper.agnostic,
        "groups": groups,
    }


@config_group.command("validate")
@click.argument("file", type=click.Path(dir_okay=False))
@_json_option
@_handle_errors
def config_validate(file: str, as_json: bool) -> None:
    """Check FILE; exit 2 with one line naming the bad field."""
    cfg = _load(file)
    if as_json:
        _emit_json({"ok": True, "file": file, "model": cfg.model.name})
        return
    click.echo(f"{file}: ok (model {cfg.model.name}, {len(cfg.model.groups)} group(s))")


@config_group.command("show")
@click.argument("file", type=click.Path(dir_okay=False))
@_json_option
@_handle_errors
def config_show(file: str, as_json: bool) -> None:
    """Print FILE resolved with defaults and the namespace directory it maps to."""
    import yaml

    cfg = _load(file)
    info = resolved_config(cfg)
    if as_json:
        _emit_json({"ok": True, "file": file, **info})
        return
    from rich.table import Table

    console = _console()
    console.print(f"# {file}, resolved with defaults", markup=False)
    console.print(yaml.safe_dump(info["config"], sort_keys=False).rstrip(), markup=False)
    console.print()
    console.print(f"namespace dir: {info['namespace_dir']}", markup=False)
    console.print(f"blocks dir:    {info['blocks_dir']}", markup=False)
    console.print(
        f"digest:        {info['digest']}   parallel-agnostic: {info['parallel_agnostic']}",
        markup=False,
    )
    table = Table(title="groups")
    for col in ("group", "kind", "page bytes", "file payload", "format", "shared across ranks"):
        table.add_column(col)
    for g in info["groups"]:
        table.add_row(
            str(g["group"]),
            g["kind"],
            f"{g['page_bytes']:,}",
            f"{g['file_payload_bytes']:,}",
            g["format_id"],
            "yes" if g["shared_across_ranks"] else "no (rank-private)",
        )
    console.print(table)


# -- inspect -----------------------------------------------------------------
@main.command("inspect")
@click.argument("root", type=click.Path(file_okay=False))
@_json_option
@_handle_errors
def inspect_cmd(root: str, as_json: bool) -> None:
    """One row per namespace under ROOT: model, parallel layout, files, bytes, ages."""
    from fstier._cli_scan import scan_root

    report = scan_root(_existing_root(root))
    if as_json:
        _emit_json(
            {
                "ok": True,
                "root": report.root,
                "namespaces": [ns.to_json() for ns in report.namespaces],
                "stray_entries": report.stray_entries,
                "total_files": sum(ns.files for ns in report.namespaces),
                "total_bytes": sum(ns.bytes for ns in report.namespaces),
            }
        )
        return
    from rich.table import Table

    table = Table(title=f"fstier root {report.root}")
    for col in ("namespace", "model", "revision", "parallel", "groups", "files", "bytes", "oldest", "newest", "temp"):
        # Names are what people copy into --namespace: never fold them.
        table.add_column(col, no_wrap=col in ("namespace", "parallel"), min_width=24 if col == "model" else None, overflow="fold")
    for ns in report.namespaces:
        groups = "-" if ns.num_groups is None else str(ns.num_groups)
        model = ns.model if ns.model is not None else f"? ({ns.manifest_error})"
        table.add_row(
            ns.namespace,
            model,
            ns.revision or "-",
            ns.parallel,
            groups,
            f"{ns.files:,}",
            _fmt_size(ns.bytes),
            _fmt_time(ns.oldest),
            _fmt_time(ns.newest),
            str(ns.temp_files),
        )
    console = _console()
    console.print(table)
    total_files = sum(ns.files for ns in report.namespaces)
    total_bytes = sum(ns.bytes for ns in report.namespaces)
    console.print(
        f"{len(report.namespaces)} namespace(s), {total_files:,} block file(s), "
        f"{_fmt_size(total_bytes)}; {report.stray_entries} other top-level entries",
        markup=False,
    )


# -- verify ------------------------------------------------------------------
@main.command("verify")
@click.argument("root", type=click.Path(file_okay=False))
@click.option("--namespace", "namespace", default=None, help="Only this namespace directory name.")
@click.option("--fix", is_flag=True, help="Remove every bad block file (and stale temp files).")
@click.option(
    "--headers-only",
    is_flag=True,
    help="Check headers, keys and lengths but skip reading payloads (fast).",
)
@_json_option
@_handle_errors
def verify_cmd(root: str, namespace: str | None, fix: bool, headers_only: bool, as_json: bool) -> None:
    """Read and check every block under ROOT (header, key, length, checksum).

    Exit 1 when a bad file was found and not removed.
    """
    from fstier._cli_verify import run_verify

    root_path = _existing_root(root)
    if namespace is not None:
        # One directory name, never a path: --fix must not reach outside ROOT.
        ns_path = root_path / namespace
        if namespace in ("", ".", "..") or "/" in namespace or "\0" in namespace:
            raise _Fail(EXIT_USAGE, f"--namespace {namespace!r}: must be one directory name under ROOT (see fstier inspect)")
        if ns_path.is_symlink() or not ns_path.is_dir():
            raise _Fail(EXIT_USAGE, f"--namespace {namespace!r}: no such namespace directory under {root}")
    show_progress = not as_json and sys.stderr.isatty()
    report = run_verify(root_path, namespace=namespace, fix=fix, full=not headers_only, progress=show_progress)
    if as_json:
        _emit_json({"ok": report.ok, **report.to_json()})
    else:
        from rich.table import Table

        console = _console()
        table = Table(title=f"verify {root}" + (" (headers only)" if headers_only else ""))
        for col in ("namespace", "checked", "ok", "bad", "removed", "bytes"):
            table.add_column(col)
        for ns in report.namespaces:
            table.add_row(
                ns.namespace, f"{ns.checked:,}", f"{ns.good:,}", f"{ns.bad:,}", f"{ns.removed:,}", _fmt_size(ns.bytes)
            )
        console.print(table)
        for bad in report.bad[:50]:
            state = "removed" if bad.removed else "kept"
            console.print(f"bad: {bad.path}: {bad.reason} ({state})", markup=False)
        if len(report.bad) > 50:
            console.print(f"... and {len(report.bad) - 50} more (use --json for all)", markup=False)
        verdict = "ok" if report.ok else "BAD FILES REMAIN (rerun with --fix to remove them)"
        console.print(
            f"{report.checked:,} file(s) checked in {report.seconds:.2f} s: {len(report.bad)} bad, "
            f"{report.removed} removed; {verdict}",
            markup=False,
        )
    if not report.ok:
        sys.exit(EXIT_FAILURE)


# -- gc ----------------------------------------------------------------------
@main.command("gc")
@click.argument("root", type=click.Path(file_okay=False))
@click.option("--max-bytes", "max_bytes", required=True, help="Target size, e.g. 500GiB or 2TB.")
@click.option("--dry-run", is_flag=True, help="Report what would be removed; remove nothing.")
@click.option(
    "--temp-max-age",
    "temp_max_age",
    type=float,
    default=3600.0,
    show_default=True,
    help="Seconds after which an orphan temp file is swept.",
)
@_json_option
@_handle_errors
def gc_cmd(root: str, max_bytes: str, dry_run: bool, temp_max_age: float, as_json: bool) -> None:
    """Evict least-recently-used blocks under ROOT down to --max-bytes and sweep
    stale temp files, with the same code as FsTier's capacity manager."""
    from fstier._cli_gc import run_gc

    limit = _parse_size_option(max_bytes, "--max-bytes")
    if temp_max_age <= 0:
        raise _Fail(EXIT_USAGE, f"--temp-max-age: must be > 0, got {temp_max_age}")
    result = run_gc(_existing_root(root), limit, dry_run=dry_run, temp_max_age_s=temp_max_age)
    ok = result["errors"] == 0
    if as_json:
        _emit_json({"ok": ok, **result})
        if not ok:
            sys.exit(EXIT_FAILURE)
        return
    verb = "would remove" if dry_run else "removed"
    click.echo(
        f"{root}: {_fmt_size(result['bytes_before'])} in {result['files_before']:,} block file(s); "
        f"target {_fmt_size(limit)}"
    )
    click.echo(
        f"{verb} {result['evicted_files']:,} block file(s) ({_fmt_size(result['evicted_bytes'])}) "
        f"and {result['temp_removed']} stale temp file(s); "
        f"{_fmt_size(result['bytes_after'])} remain"
    )
    if not ok:
        click.echo(f"{result['errors']} file(s) could not be examined or removed (see above)", err=True)
        sys.exit(EXIT_FAILURE)


# -- bench -------------------------------------------------------------------
@main.command("bench")
@click.option("--root", "root", type=click.Path(file_okay=False), default=None, help="Directory to test (default: a temp dir).")
@click.option("--block-size", "block_size", default="2MiB", show_default=True, help="Bytes per block file.")
@click.option("--blocks", "num_blocks", type=int, default=256, show_default=True, help="Files per pass.")
@click.option("--threads", type=int, default=8, show_default=True, help="I/O threads for both sides.")
@_json_option
@_handle_errors
def bench_cmd(root: str | None, block_size: str, num_blocks: int, threads: int, as_json: bool) -> None:
    """fstier store/load vs raw O_DIRECT on the same directory in the same run."""
    from fstier._bench import run_bench

    size = _parse_size_option(block_size, "--block-size")
    if size < 4096 or size % 4096:
        raise _Fail(EXIT_USAGE, f"--block-size: must be a multiple of 4096, got {size}")
    if num_blocks < 1:
        raise _Fail(EXIT_USAGE, f"--blocks: must be >= 1, got {num_blocks}")
    if threads < 1:
        raise _Fail(EXIT_USAGE, f"--threads: must be >= 1, got {threads}")
    result = run_bench(Path(root) if root else None, block_bytes=size, num_blocks=num_blocks, threads=threads)
    if as_json:
        _emit_json({"ok": True, **result})
        return
    from rich.table import Table

    table = Table(title="fstier bench")
    for col in ("op", "fstier GB/s", "raw O_DIRECT GB/s", "ratio"):
        table.add_column(col)
    for row in result["rows"]:
        table.add_row(row["op"], f"{row['fstier_gbps']:.2f}", f"{row['raw_gbps']:.2f}", f"{row['ratio']:.2f}")
    console = _console()
    console.print(table)
    console.print(
        f"{result['num_blocks']} x {_fmt_size(size)} files, {threads} threads, median of "
        f"{result['rounds']} rounds after a warm-up, on {result['root']} (o_direct={result['o_direct']})",
        markup=False,
    )


# -- demo --------------------------------------------------------------------
@main.command("demo")
@click.option("--root", "root", type=click.Path(file_okay=False), default=None, help="Root directory (default: a fresh temp dir, removed after).")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), default=None, help="YAML config: its tier settings (and a full-attention model) are used.")
@click.option("--per-layer", is_flag=True, help="Allocate one KV tensor per layer instead of the cross-layer layout.")
@_json_option
@_handle_errors
def demo_cmd(root: str | None, config_file: str | None, per_layer: bool, as_json: bool) -> None:
    """The end-to-end tour: tp=2 ranks store, tp=4 ranks load, and every
    fail-closed case (MLA, hybrid, corruption, restart). Exit 0 only when
    every outcome matches what is expected."""
    # The config first: a bad file is exit 2 before anything heavy is imported.
    cfg = _load(config_file) if config_file else None
    from fstier._demo import DemoOptions, run_demo

    show_progress = not as_json and sys.stderr.isatty()
    opts = DemoOptions(
        root=Path(root) if root else None,
        config=cfg,
        per_layer=per_layer,
        progress=show_progress,
    )
    report = run_demo(opts)
    if as_json:
        _emit_json(report.to_json())
    else:
        _print_demo(report)
    if not report.ok:
        sys.exit(EXIT_FAILURE)


def _print_demo(report: Any) -> None:
    from rich.table import Table

    console = _console()
    table = Table(title=f"fstier demo ({report.layout} KV layout) root={report.root}")
    for col in ("case", "expected", "outcome", "", "stored", "loaded", "bytes", "GB/s", "detail"):
        table.add_column(col, overflow="fold")
    for case in report.cases:
        mark = "[green]ok[/green]" if case.ok else "[red]MISMATCH[/red]"
        table.add_row(
            case.name,
            case.expected,
            case.outcome,
            mark,
            str(case.stored_blocks),
            str(case.loaded_blocks),
            _fmt_size(case.bytes),
            f"{case.gbps:.2f}" if case.gbps else "-",
            case.detail,
        )
    console.print(table)
    verdict = "[green]all outcomes as expected[/green]" if report.ok else "[red]some outcomes differ[/red]"
    console.print(
        f"store {report.store_gbps:.2f} GB/s, load {report.load_gbps:.2f} GB/s "
        f"(o_direct={report.o_direct}); {verdict}; {report.seconds:.1f} s"
    )


def _entry() -> None:  # pragma: no cover - python -m fstier.cli
    main(prog_name="fstier")


if __name__ == "__main__":  # pragma: no cover
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    _entry()
