"""``fstier config validate|show FILE``: check a YAML config, or print it
resolved with every default and the namespace directory it maps to."""

from __future__ import annotations

from typing import Any

import click

from fstier.cli._common import (
    _console,
    _emit_report,
    _handle_errors,
    _json_option,
)


@click.group("config")
def config_group() -> None:
    """Validate or show a YAML configuration."""


def _load(path: str) -> Any:
    from fstier.config import load_config

    return load_config(path)


def resolved_config(cfg: Any) -> dict[str, Any]:
    """The config with every default filled in, plus what it maps to on disk."""
    from fstier.canonical import canonical_format_id, canonical_page_bytes, is_certified
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
        _emit_report({"file": file, "model": cfg.model.name})
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
        _emit_report({"file": file, **info})
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

