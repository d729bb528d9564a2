"""Engine options -> :class:`~fstier.config.TierConfig`, shared by the
engine integrations (vLLM's ``secondary_tiers`` entry, SGLang's
``--hicache-storage-backend-extra-config``).

An integration's options are: ``root_dir``, ``config`` (an fstier YAML whose
``tier:`` section gives defaults), any tier field inline (``<field>`` or
``tier.<field>``, overriding the YAML), and the engine's own keys, which the
caller removes first. Anything else is a :class:`~fstier.errors.ConfigError`
naming the key, the keys that are accepted and the doc to read. Costs: one
YAML read when ``config`` is given; nothing on any hot path.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from fstier.config import TierConfig, format_validation_error
from fstier.config_file import read_config_text, shown, yaml_document
from fstier.errors import ConfigError

__all__ = ["tier_config_from_engine_options"]

log = logging.getLogger("fstier.integrations")

#: Top-level YAML sections fstier knows; only ``tier`` applies under an engine.
_YAML_SECTIONS = frozenset({"tier", "model", "parallel"})


class _TierOnly(BaseModel):
    """Validation wrapper so errors read ``tier.<field>``."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    tier: TierConfig


def _yaml_tier_section(path: object, who: str, engine: str) -> dict[str, Any]:
    if not isinstance(path, str | Path):
        raise ConfigError(
            f"{who} option 'config': expected a path to an fstier YAML file, got {shown(path)}"
        )
    p = Path(path).expanduser()
    data = yaml_document(read_config_text(p, f"{who} option 'config':"), p)
    if not isinstance(data, dict) or not isinstance(data.get("tier"), dict):
        raise ConfigError(
            f"{p}: {who} reads the file's 'tier:' mapping ({engine} supplies the model and "
            "parallel layout), but it has none; write 'tier:' with fields such as max_bytes"
        )
    unknown = sorted(str(k) for k in data if k not in _YAML_SECTIONS)
    if unknown:
        raise ConfigError(
            f"{p}: {shown(unknown[0])}: unknown section; expected tier (model and parallel are "
            f"ignored under {engine})"
        )
    ignored = sorted(k for k in data if k != "tier")
    if ignored:
        log.info("fstier: %s: ignoring section(s) %s; %s supplies them", p, ", ".join(ignored), engine)
    return dict(data["tier"])


def tier_config_from_engine_options(
    options: Mapping[str, Any],
    *,
    who: str,
    engine: str,
    engine_keys: Collection[str],
    aliases: Mapping[str, str],
    doc: str,
) -> TierConfig:
    """The :class:`TierConfig` of an integration's options (the engine's own
    keys already removed): ``config``'s ``tier:`` section, then inline tier
    fields (``tier.<field>``, ``<field>`` or an ``aliases`` spelling) over it.

    ``who`` names the integration in messages (``FstierTier``), ``engine`` the
    engine (``vLLM``), ``engine_keys`` the keys the engine may pass (listed in
    the unknown-key message), ``doc`` the page to read. Raises
    :class:`ConfigError` naming the first bad option."""
    opts = dict(options)
    config = opts.pop("config", None)
    base = _yaml_tier_section(config, who, engine) if config is not None else {}
    fields = TierConfig.model_fields
    inline: dict[str, Any] = {}
    for raw_key, value in opts.items():
        key = str(raw_key).removeprefix("tier.")
        key = aliases.get(key, key)
        if key not in fields:
            raise ConfigError(
                f"{who} option {shown(raw_key)}: unknown; expected root_dir, config, a tier "
                f"field ({', '.join(sorted(f for f in fields if f != 'root_dir'))}) or one of "
                f"{engine}'s keys ({', '.join(sorted({*engine_keys, *aliases}))}); see {doc}"
            )
        inline[key] = value
    merged = {**base, **inline}
    if merged.get("root_dir") is None:
        raise ConfigError(
            f"{who} option 'root_dir': required; give the directory for block files "
            'inline ("root_dir": "/mnt/kv") or in the config YAML\'s tier: section'
        )
    try:
        return _TierOnly.model_validate({"tier": merged}).tier
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, f"{who} options")) from None
