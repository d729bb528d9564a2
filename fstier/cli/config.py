"""``fstier config validate|show FILE``: check a configuration, or print it
resolved with every default and the namespace directory it maps to.

FILE (``-`` reads stdin) is one of three documents, told apart by shape:

- a full fstier YAML (``tier:`` + ``model:`` [+ ``parallel:``]), what
  :func:`fstier.load_config` reads;
- a tier-only YAML (``tier:`` alone; ``model:``/``parallel:`` are ignored),
  what FstierTier's ``config`` option reads under vLLM, which supplies the
  model and the parallel layout;
- vLLM JSON: a ``secondary_tiers`` entry (``{"type": "FstierTier", ...}``),
  the ``secondary_tiers`` list, ``kv_connector_extra_config``, or the whole
  ``--kv-transfer-config``. Every FstierTier entry is validated exactly as
  FstierTier's constructor does (sizes with vLLM's meaning of a bare letter:
  ``2T`` = 2 TiB), plus the keys without which vLLM does not start.

``--check-root`` then proves each tier's ``root_dir`` on this host
(:mod:`fstier.cli.rootcheck`). For vLLM JSON holding ``cpu_bytes_to_use``,
``--max-model-len`` with ``--kv-bytes-per-token`` warns (exit 0) when
vLLM's CPU tier cannot hold the KV of one longest prompt: vLLM 0.33 serves
a FstierTier hit only through it (:func:`cpu_tier_warning`). Neither command
imports torch.
"""

from __future__ import annotations

import sys
from typing import Any

import click

from fstier.cli.exits import ReportFailed
from fstier.cli.options import json_option
from fstier.cli.output import emit_report, make_console
from fstier.config_file import (
    cut,
    json_document,
    read_config_stream,
    read_config_text,
    shown,
    yaml_document,
)
from fstier.errors import ConfigError


@click.group("config")
def config_group() -> None:
    """Validate or show a YAML configuration."""


def _read_document(file: str) -> tuple[Any, str]:
    """The parsed document of FILE (or stdin for ``-``) and its source name,
    read and parsed within :mod:`fstier.config_file`'s limits."""
    if file == "-":
        text, source = read_config_stream(sys.stdin.buffer), "<stdin>"
    else:
        text, source = read_config_text(file), cut(file, 256)
    if text.lstrip().startswith(("{", "[")):
        return json_document(text, source), source
    return yaml_document(text, source), source


_VLLM_SHAPES = ("type", "secondary_tiers", "kv_connector_extra_config", "kv_connector")


def document_kind(data: Any) -> str:
    """``full``, ``tier`` or ``vllm`` (see the module docstring)."""
    if isinstance(data, list) and data and all(isinstance(e, dict) for e in data):
        return "vllm"  # a secondary_tiers list (anything else is not a config at all)
    if isinstance(data, dict) and any(k in data for k in _VLLM_SHAPES):
        return "vllm"
    if isinstance(data, dict) and "tier" in data and "model" not in data:
        return "tier"
    return "full"


def _tier_only(data: dict[str, Any], source: str) -> Any:
    """The TierConfig of a tier-only document (errors read ``tier.<field>``)."""
    from pydantic import BaseModel, ConfigDict, ValidationError

    from fstier.config import TierConfig, format_validation_error

    class TierOnly(BaseModel):
        model_config = ConfigDict(extra="forbid", frozen=True)
        tier: TierConfig

    unknown = sorted(str(k) for k in data if k not in ("tier", "model", "parallel"))
    if unknown:
        raise ConfigError(f"{source}: {shown(unknown[0])}: unknown section; expected tier, model, parallel")
    try:
        return TierOnly.model_validate({"tier": data["tier"]}).tier
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, source)) from None


#: Keys of a secondary_tiers entry that vLLM consumes or FstierTier pops
#: before the tier options are validated.
_ENTRY_KEYS = ("type", "module_path", "backpressure", "locality", "enable_kv_events")


def vllm_tiers(data: Any, source: str) -> list[tuple[str, Any]]:
    """Every FstierTier entry of a vLLM JSON document, validated as FstierTier
    would, as ``(label, TierConfig)``; raises ConfigError naming the first
    problem (including the keys without which vLLM does not start)."""
    from fstier.integrations._vllm_config import tier_config_from_options  # no vLLM import

    entries: Any = data
    where = source
    if isinstance(data, dict) and ("kv_connector" in data or "kv_role" in data):
        for key, want in (("kv_connector", "OffloadingConnector"), ("kv_role", "kv_both")):
            if key not in data:
                raise ConfigError(
                    f"{source}: {key}: required by vLLM's --kv-transfer-config (use {want!r})"
                )
        data = data.get("kv_connector_extra_config")
        if not isinstance(data, dict):
            raise ConfigError(
                f"{source}: kv_connector_extra_config: required, a mapping with spec_name, "
                "cpu_bytes_to_use and secondary_tiers"
            )
        where = f"{source}: kv_connector_extra_config"
    elif isinstance(data, dict) and "kv_connector_extra_config" in data:
        data = data["kv_connector_extra_config"]
        where = f"{source}: kv_connector_extra_config"
    if isinstance(data, dict) and "secondary_tiers" in data:
        if "cpu_bytes_to_use" not in data:
            raise ConfigError(
                f"{where}: cpu_bytes_to_use: required by vLLM's offloading connector (bytes of "
                "its CPU tier, a /dev/shm file; e.g. 34359738368 for 32 GiB)"
            )
        entries = data["secondary_tiers"]
        where = f"{where}.secondary_tiers"
    if isinstance(entries, dict):
        entries = [entries]
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{where}: expected a list of tier entries such as "
                          '[{"type": "FstierTier", "module_path": "fstier.integrations.vllm", "root_dir": "/mnt/kv"}]')
    out: list[tuple[str, Any]] = []
    for i, entry in enumerate(entries):
        label = f"{where}[{i}]" if len(entries) > 1 or where != source else source
        if not isinstance(entry, dict):
            raise ConfigError(f"{label}: expected a mapping, got {type(entry).__name__}")
        if entry.get("type") != "FstierTier":
            continue
        if entry.get("module_path") != "fstier.integrations.vllm":
            raise ConfigError(
                f"{label}: module_path: must be 'fstier.integrations.vllm' for type FstierTier, "
                f"got {shown(entry.get('module_path'))} (vLLM would not find the tier)"
            )
        locality = entry.get("locality")
        if locality is not None and locality not in ("LOCAL", "REMOTE"):
            raise ConfigError(f"{label}: locality: expected LOCAL or REMOTE, got {shown(locality)}")
        events = entry.get("enable_kv_events")
        if events is not None and not isinstance(events, bool):
            raise ConfigError(f"{label}: enable_kv_events: expected true or false, got {shown(events)}")
        options = {k: v for k, v in entry.items() if k not in _ENTRY_KEYS}
        try:
            out.append((label, tier_config_from_options(options)))
        except ConfigError as exc:
            raise ConfigError(f"{label}: {exc}") from None
    if not out:
        raise ConfigError(f"{where}: no entry with \"type\": \"FstierTier\"")
    return out


def _cpu_bytes_to_use(data: Any) -> int | None:
    """``cpu_bytes_to_use`` of a vLLM JSON document (a whole ``--kv-transfer-config`` or its
    ``kv_connector_extra_config``), or None where the document does not hold it (an entry, a list)."""
    from fstier.units import parse_size

    if isinstance(data, dict) and isinstance(data.get("kv_connector_extra_config"), dict):
        data = data["kv_connector_extra_config"]
    value = data.get("cpu_bytes_to_use") if isinstance(data, dict) else None
    if value is None or isinstance(value, bool):
        return None
    try:
        return parse_size(value, vllm_letters=True) if isinstance(value, str) else int(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"cpu_bytes_to_use: {exc}") from None


def cpu_tier_warning(data: Any, max_model_len: int | None, kv_bytes_per_token: int | None) -> str | None:
    """The warning ``config validate`` prints for a vLLM document whose CPU tier cannot hold the KV of one
    prompt of ``max_model_len`` tokens (:func:`~fstier.integrations._vllm_config.cpu_tier_shortfall`), or None.
    Both numbers are needed; a document without ``cpu_bytes_to_use`` cannot be checked (a usage error)."""
    if max_model_len is None and kv_bytes_per_token is None:
        return None
    if max_model_len is None or kv_bytes_per_token is None:
        raise click.UsageError("--max-model-len and --kv-bytes-per-token go together (the CPU tier check needs both)")
    cpu_bytes = _cpu_bytes_to_use(data)
    if cpu_bytes is None:
        raise click.UsageError(
            "--max-model-len: this document has no cpu_bytes_to_use; give the whole --kv-transfer-config "
            "or its kv_connector_extra_config"
        )
    from fstier.integrations._vllm_config import cpu_tier_shortfall
    from fstier.units import format_size

    what = f"cpu_bytes_to_use {format_size(cpu_bytes)} at {kv_bytes_per_token:,} KV bytes per token"
    return cpu_tier_shortfall(cpu_bytes // kv_bytes_per_token, max_model_len, cpu_what=what)


def _summary(tier: Any) -> str:
    from fstier.units import format_size

    size = "unset (no eviction)" if tier.max_bytes is None else format_size(tier.max_bytes)
    return f"root_dir {tier.root_dir}, max_bytes {size}"


@config_group.command("validate")
@click.argument("file", type=click.Path(dir_okay=False, allow_dash=True))
@click.option(
    "--check-root", is_flag=True,
    help="Also prove each tier's root_dir on this host: create, write, O_DIRECT, free space, owner UID.",
)
@click.option(
    "--max-model-len", type=click.IntRange(min=1), default=None,
    help="vLLM's max_model_len: warn when cpu_bytes_to_use cannot hold one such prompt's KV (vLLM JSON).",
)
@click.option(
    "--kv-bytes-per-token", type=click.IntRange(min=1), default=None,
    help="The model's KV bytes per token, all layers and ranks (2 x layers x KV heads x head size x dtype bytes).",
)
@json_option
def config_validate(
    file: str, check_root: bool, max_model_len: int | None, kv_bytes_per_token: int | None, as_json: bool
) -> None:
    """Check FILE; exit 2 with one line naming the bad field.

    FILE is a full fstier YAML, a tier-only YAML (FstierTier's config option)
    or vLLM JSON holding FstierTier entries; '-' reads stdin. With
    --check-root, exit 1 when a root check fails. With --max-model-len and
    --kv-bytes-per-token (vLLM JSON with cpu_bytes_to_use), a warning when
    vLLM's CPU tier cannot hold one longest prompt (exit 0).
    """
    data, source = _read_document(file)
    kind = document_kind(data)
    if kind != "vllm" and (max_model_len is not None or kv_bytes_per_token is not None):
        raise click.UsageError("--max-model-len and --kv-bytes-per-token check vLLM JSON (cpu_bytes_to_use)")
    model: str | None = None
    if kind == "full":
        from fstier.config import parse_config

        cfg = parse_config(data, source=source)
        tiers = [(source, cfg.tier)]
        model = cfg.model.name
        what = f"model {cfg.model.name}, {len(cfg.model.groups)} group(s)"
    elif kind == "tier":
        tiers = [(source, _tier_only(data, source))]
        what = f"tier-only, {_summary(tiers[0][1])}; vLLM supplies model and parallel"
    else:
        tiers = vllm_tiers(data, source)
        what = "; ".join(f"FstierTier {_summary(t)}" for _, t in tiers)
    warning = cpu_tier_warning(data, max_model_len, kv_bytes_per_token) if kind == "vllm" else None
    checks: list[tuple[str, Any]] = []
    if check_root:
        from fstier.cli.rootcheck import check_root as run_checks

        checks = [(label, c) for label, t in tiers for c in run_checks(t)]
    failed = [c for _, c in checks if c.status == "fail"]
    verdict = failed[0].detail if failed else None
    if as_json:
        doc: dict[str, Any] = {"file": file, "kind": kind}
        if model is not None:
            doc["model"] = model
        doc["tiers"] = [{**t.model_dump(mode="json"), "file_mode": f"{t.file_mode:04o}"} for _, t in tiers]
        if check_root:
            doc["root_checks"] = [{"tier": label, **c.to_json()} for label, c in checks]
        if max_model_len is not None:
            doc["warnings"] = [] if warning is None else [warning]
        emit_report(doc, verdict)
        if verdict is not None:
            raise ReportFailed(verdict)
        return
    click.echo(f"{file}: ok ({what})")
    if warning is not None:
        click.echo(f"  warning: {warning}")
    for label, c in checks:
        prefix = f"{label}: " if len(tiers) > 1 else ""
        click.echo(f"  {c.status:<4} {c.name:<8} {prefix}{c.detail}")
    if verdict is not None:
        raise ReportFailed(f"root check failed: {verdict}")


def agnostic_reason(cfg: Any) -> str | None:
    """Why a config's namespace keeps the parallel layout (None when it is
    parallel-agnostic): the first rule of :func:`fstier.is_parallel_agnostic`
    it breaks, in words an operator can act on."""
    from fstier.canonical import cp_world, head_ranks, is_certified
    from fstier.file_mapper import is_parallel_agnostic

    model, par = cfg.model, cfg.parallel
    if is_parallel_agnostic(model, par):
        return None
    if len(model.groups) != 1:
        return (
            f"the model has {len(model.groups)} KV groups; only a single full-attention group is shared across layouts"
        )
    g = model.groups[0]
    if g.kind != "full_attention":
        return f"the group's kind is {g.kind!r}; only 'full_attention' is shared across layouts"
    if par.model_runner == "v2":
        return "model_runner v2 keeps the parallel layout in the namespace"
    if not is_certified(g, par):
        hr = head_ranks(par)
        if not (g.num_kv_heads % hr == 0 or hr % g.num_kv_heads == 0):
            return (
                f"num_kv_heads {g.num_kv_heads} neither divides nor is divided by the {hr} head-parallel "
                f"ranks (tp_size {par.tp_size} / dcp_size {par.dcp_size}), so pages split unevenly and "
                f"are rank-private; use a tp_size that divides {g.num_kv_heads} (or a multiple of it)"
            )
        return (
            f"block_size {g.block_size} does not split evenly over the {cp_world(par)} context-parallel "
            f"ranks (cp_kv_cache_interleave_size {par.cp_kv_cache_interleave_size})"
        )
    return "the layout is not certified as parallel-agnostic"


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
        "not_agnostic_because": agnostic_reason(cfg),
        "groups": groups,
    }


@config_group.command("show")
@click.argument("file", type=click.Path(dir_okay=False, allow_dash=True))
@json_option
def config_show(file: str, as_json: bool) -> None:
    """Print FILE resolved with defaults and the namespace directory it maps to."""
    import yaml

    data, source = _read_document(file)
    kind = document_kind(data)
    if kind != "full":
        tiers = [(source, _tier_only(data, source))] if kind == "tier" else vllm_tiers(data, source)
        resolved = []
        for label, t in tiers:
            dumped = t.model_dump(mode="json")
            dumped["file_mode"] = f"{t.file_mode:04o}"
            resolved.append({"source": label, "tier": dumped})
        if as_json:
            emit_report({"file": file, "kind": kind, "tiers": resolved})
            return
        for r in resolved:
            click.echo(f"# {r['source']}: tier resolved with defaults ({kind}; vLLM supplies model and parallel)")
            click.echo(yaml.safe_dump({"tier": r["tier"]}, sort_keys=False).rstrip())
        return
    from fstier.config import parse_config

    cfg = parse_config(data, source=source)
    info = resolved_config(cfg)
    if as_json:
        emit_report({"file": file, **info})
        return
    from rich.table import Table

    console = make_console()
    console.print(f"# {file}, resolved with defaults", markup=False)
    console.print(yaml.safe_dump(info["config"], sort_keys=False).rstrip(), markup=False)
    console.print()
    console.print(f"namespace dir: {info['namespace_dir']}", markup=False)
    console.print(f"blocks dir:    {info['blocks_dir']}", markup=False)
    console.print(
        f"digest:        {info['digest']}   parallel-agnostic: {info['parallel_agnostic']}",
        markup=False,
    )
    if info["not_agnostic_because"]:
        console.print(f"not parallel-agnostic: {info['not_agnostic_because']}", markup=False, soft_wrap=True)
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

