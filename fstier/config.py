"""Typed configuration: the model, its parallel layout and the tier.

Everything is a pydantic v2 model with ``extra="forbid"``; :func:`load_config`
reads YAML through :mod:`fstier.config_file` (regular files only, never
blocking, size, depth and integer limits). Every problem becomes one
:class:`~fstier.errors.ConfigError` whose one-line message names the field
path, the bad value and what is expected, e.g.
``tier.read_threads: must be >= 1, got 0``. Sizes accept units ("512MiB",
"2TB", "870Gi"; see :mod:`fstier.units`). This module must not import
torch: the CLI imports it.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from fstier.config_file import cut, read_config_text, shown, yaml_document
from fstier.errors import ConfigError
from fstier.units import parse_size

__all__ = [
    "DTYPE_SIZES",
    "FstierConfig",
    "KVGroupSpec",
    "ModelSpec",
    "ParallelSpec",
    "TierConfig",
    "format_validation_error",
    "load_config",
    "parse_config",
    "yaml_document",
]

#: Element size in bytes of every KV dtype fstier knows (torch names).
DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}
_DTYPE_ALIASES = {
    "fp32": "float32",
    "float": "float32",
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}


def _normalize_dtype(value: object) -> object:
    if isinstance(value, str):
        name = value.strip().removeprefix("torch.")
        name = _DTYPE_ALIASES.get(name, name)
        if name not in DTYPE_SIZES:
            raise ValueError(f"unknown dtype {shown(value)}; expected one of {sorted(DTYPE_SIZES)}")
        return name
    return value


def _size(value: object) -> object:
    return None if value is None else parse_size(value)


def _file_mode(value: object) -> object:
    if isinstance(value, str):
        try:
            return int(value, 8)
        except ValueError:
            raise ValueError(f"expected an octal file mode such as '0644', got {shown(value)}") from None
    return value


Dtype = Annotated[str, BeforeValidator(_normalize_dtype)]
Size = Annotated[int, BeforeValidator(_size), Field(ge=0)]
OptSize = Annotated[Annotated[int, Field(ge=0)] | None, BeforeValidator(_size)]

#: Upper bounds of the time options (seconds): a day for timeouts, TTLs and
#: the breaker's cool-down, an hour of queued writes, a year for temp files.
MAX_SECONDS = 86_400.0
MAX_QUEUE_SECONDS = 3_600.0
MAX_TEMP_AGE_SECONDS = 365 * 86_400.0

_STRICT = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class KVGroupSpec(BaseModel):
    """One KV cache group: layers that share a block table and page shape.

    ``num_kv_heads`` is the total number of KV heads of the model, not per
    rank. For ``mla`` the group has one latent "head" of ``head_size``
    elements per token; for ``mamba`` the page is opaque state of
    ``page_size_bytes`` per layer per block.
    """

    model_config = _STRICT

    kind: Literal["full_attention", "sliding_window", "mla", "mamba"] = "full_attention"
    block_size: int = Field(16, ge=1, description="tokens per GPU block")
    num_layers: int = Field(1, ge=1)
    num_kv_heads: int = Field(1, ge=1, description="total KV heads of the model")
    head_size: int = Field(0, ge=0, description="elements per head (latent size for MLA)")
    dtype: Dtype | None = None
    kv_layout: Literal["NHD", "HND"] = "NHD"
    sliding_window: int | None = Field(None, ge=1)
    page_size_bytes: OptSize = Field(None, description="opaque state bytes per layer per block")

    @model_validator(mode="after")
    def _check_kind(self) -> KVGroupSpec:
        if self.kind in ("full_attention", "sliding_window", "mla") and self.head_size < 1:
            if "head_size" not in self.model_fields_set:
                raise ValueError(
                    f"head_size is required for kind {self.kind!r}: elements per KV head "
                    "(the model's head_dim, e.g. 128; the latent size for 'mla')"
                )
            raise ValueError(f"head_size must be >= 1 for kind {self.kind!r}, got {self.head_size}")
        if self.kind == "sliding_window" and self.sliding_window is None:
            raise ValueError("sliding_window (tokens) is required for kind 'sliding_window'")
        if self.kind != "sliding_window" and self.sliding_window is not None:
            raise ValueError(f"sliding_window is only valid for kind 'sliding_window', not {self.kind!r}")
        if self.kind == "mamba" and not self.page_size_bytes:
            raise ValueError("page_size_bytes (> 0) is required for kind 'mamba'")
        if self.kind == "mla" and self.num_kv_heads != 1:
            raise ValueError(f"num_kv_heads must be 1 for kind 'mla' (one latent), got {self.num_kv_heads}")
        return self

    @property
    def element_size(self) -> int:
        """Bytes per element of this group's dtype (after model defaults)."""
        if self.dtype is None:
            raise ConfigError("group dtype is unresolved; build groups through ModelSpec")
        return DTYPE_SIZES[self.dtype]

    @property
    def layer_page_bytes(self) -> int:
        """Bytes of one block of one layer (K and V for attention)."""
        if self.kind == "mamba":
            return int(self.page_size_bytes or 0)
        if self.kind == "mla":
            return self.block_size * self.head_size * self.element_size
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.element_size

    @property
    def page_bytes(self) -> int:
        """Bytes of one canonical page: all layers, all heads, all tokens of a block."""
        return self.num_layers * self.layer_page_bytes


class ModelSpec(BaseModel):
    """The model whose KV is cached. ``revision`` pins the weights identity."""

    model_config = _STRICT

    name: str = Field(min_length=1, max_length=1024)
    revision: str | None = Field(None, max_length=256)
    dtype: Dtype = "bfloat16"
    groups: list[KVGroupSpec] = Field(min_length=1)

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if "\x00" in value:
            raise ValueError("must not contain NUL bytes")
        return value

    @model_validator(mode="after")
    def _resolve_group_dtypes(self) -> ModelSpec:
        resolved = [g if g.dtype else g.model_copy(update={"dtype": self.dtype}) for g in self.groups]
        object.__setattr__(self, "groups", resolved)
        return self


class ParallelSpec(BaseModel):
    """The parallel layout of one rank. Rank order is PP x PCP x TP with TP
    innermost (vLLM's order); decode context parallel (DCP) splits each TP
    group, so ``dcp_size`` must divide ``tp_size``."""

    model_config = _STRICT

    tp_size: int = Field(1, ge=1)
    pp_size: int = Field(1, ge=1)
    pcp_size: int = Field(1, ge=1)
    dcp_size: int = Field(1, ge=1)
    rank: int = Field(0, ge=0)
    cp_kv_cache_interleave_size: int = Field(1, ge=1)
    model_runner: Literal["v1", "v2"] = "v1"

    @model_validator(mode="after")
    def _check(self) -> ParallelSpec:
        if self.tp_size % self.dcp_size:
            raise ValueError(f"dcp_size ({self.dcp_size}) must divide tp_size ({self.tp_size})")
        if self.rank >= self.world_size:
            raise ValueError(
                f"rank must be < world size tp*pp*pcp = {self.world_size}, got {self.rank}"
            )
        return self

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size * self.pcp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pcp_rank(self) -> int:
        return (self.rank // self.tp_size) % self.pcp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.tp_size * self.pcp_size)

    @property
    def dcp_rank(self) -> int:
        return self.tp_rank % self.dcp_size

    def with_rank(self, rank: int) -> ParallelSpec:
        """The same layout seen from another rank (validated)."""
        return ParallelSpec.model_validate({**self.model_dump(), "rank": rank})


class TierConfig(BaseModel):
    """Where and how block files are stored."""

    model_config = _STRICT

    root_dir: Path
    blocks_per_file: int = Field(1, ge=1, le=4096)
    read_threads: int = Field(8, ge=1, le=256)
    write_threads: int = Field(4, ge=1, le=256)
    o_direct: Literal["auto", "on", "off", "cold"] = "auto"
    #: the per-file I/O path: the native extension (``auto``: when it is
    #: built; ``on``: required), or ``off``: the pure-Python path.
    #: ``FSTIER_NATIVE=0`` in the environment forces ``off``.
    native_io: Literal["auto", "on", "off"] = "auto"
    checksum: Literal["xxh3", "none"] = "xxh3"
    fsync: Literal["none", "file", "file+dir"] = "none"
    file_mode: Annotated[int, BeforeValidator(_file_mode), Field(ge=0, le=0o777)] = 0o644
    max_bytes: OptSize = None
    # Every float is finite and bounded (test_config.py's
    # test_every_float_option_must_be_finite): inf or nan here
    # used to disable eviction (OverflowError in every capacity pass) or kill
    # the I/O watchdog (a wait longer than threading.TIMEOUT_MAX).
    low_watermark: float = Field(0.80, gt=0.0, lt=1.0, allow_inf_nan=False)
    high_watermark: float = Field(0.95, gt=0.0, le=1.0, allow_inf_nan=False)
    max_write_queue_seconds: float = Field(5.0, gt=0.0, le=MAX_QUEUE_SECONDS, allow_inf_nan=False)
    io_timeout_s: float = Field(30.0, gt=0.0, le=MAX_SECONDS, allow_inf_nan=False)
    namespace_salt: str = Field("", max_length=256)
    lookup_cache_ttl_s: float = Field(2.0, ge=0.0, le=MAX_SECONDS, allow_inf_nan=False)
    temp_max_age_s: float = Field(3600.0, gt=0.0, le=MAX_TEMP_AGE_SECONDS, allow_inf_nan=False)
    breaker_failures: int = Field(8, ge=1)
    breaker_cooldown_s: float = Field(10.0, gt=0.0, le=MAX_SECONDS, allow_inf_nan=False)

    @field_validator("root_dir", mode="before")
    @classmethod
    def _root(cls, value: object) -> object:
        if isinstance(value, str) and not value.strip():
            raise ValueError("must be a directory path, got an empty string")
        if isinstance(value, str) and "\x00" in value:
            raise ValueError("must not contain NUL bytes")
        return value

    @field_validator("root_dir", mode="after")
    @classmethod
    def _root_not_file(cls, value: Path) -> Path:
        value = Path(os.path.expanduser(value))
        # os.stat, not Path.exists: exists() raises PermissionError (a
        # traceback, not a config error) when a parent cannot be entered.
        try:
            st = os.stat(value)
        except FileNotFoundError:
            return value  # created on first use
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise ValueError(f"{shown(str(value))} is a symlink loop") from None
            if exc.errno == errno.ENOTDIR:
                # A file where a parent directory should be: the namespace's
                # creation (fstier.io.manifest.ensure_manifest) reports it as a
                # StorageError naming tier.root_dir, like any unwritable root
                # (test_file_mapper.py::test_unwritable_root_is_a_storage_error_naming_it).
                return value
            raise ValueError(
                f"cannot reach {shown(str(value))}: {exc.strerror or exc}; "
                "choose a directory this user can enter, or fix the parents' permissions"
            ) from None
        if not stat.S_ISDIR(st.st_mode):
            raise ValueError(f"must be a directory, but {shown(str(value))} is a file")
        return value

    @field_validator("max_bytes", mode="after")
    @classmethod
    def _max_bytes(cls, value: int | None) -> int | None:
        if value == 0:
            # 0 would make every store "succeed" and be evicted at once.
            raise ValueError(
                "must be > 0: a root of 0 bytes evicts every block as soon as it is stored; "
                "leave max_bytes unset (null) for no limit"
            )
        return value

    @model_validator(mode="after")
    def _watermarks(self) -> TierConfig:
        if self.low_watermark >= self.high_watermark:
            raise ValueError(
                f"low_watermark ({self.low_watermark}) must be below high_watermark ({self.high_watermark})"
            )
        return self


class FstierConfig(BaseModel):
    """The whole configuration: ``tier``, ``model`` and ``parallel``."""

    model_config = _STRICT

    tier: TierConfig
    model: ModelSpec
    parallel: ParallelSpec = ParallelSpec()


def format_validation_error(exc: ValidationError, source: str) -> str:
    """One line for a pydantic :class:`ValidationError`: each failed field as
    ``<path>: <what is wrong>, got <value>``, prefixed by ``source``; keys
    and values cut (:func:`fstier.config_file.shown`)."""
    parts = []
    for err in exc.errors():
        path = ".".join(map(_key, err["loc"])) or "<top>"
        kind = err["type"]
        value = err.get("input")
        if kind == "extra_forbidden":
            parts.append(f"{path}: unknown key (check the spelling; see docs/configuration.md)")
            continue
        if kind == "missing":
            parts.append(f"{path}: required field is missing")
            continue
        msg = cut(str(err["msg"]), 300)
        msg = msg.removeprefix("Value error, ").removeprefix("Assertion failed, ")
        msg = (
            msg.replace("Input should be greater than or equal to", "must be >=")
            .replace("Input should be greater than", "must be >")
            .replace("Input should be less than or equal to", "must be <=")
            .replace("Input should be less than", "must be <")
            .replace("Input should be", "must be")
        )
        if value is not None and not isinstance(value, dict | list) and "got " not in msg:
            parts.append(f"{path}: {msg}, got {shown(value)}")
        else:
            parts.append(f"{path}: {msg}")
    prefix = f"{source}: " if source else ""
    return prefix + "; ".join(parts)


def _key(part: object) -> str:
    """One element of a field path (a long or odd key cut)."""
    if isinstance(part, int) or (isinstance(part, str) and len(part) <= 64):
        return str(part)
    return shown(part, 32)


def parse_config(data: Any, source: str = "") -> FstierConfig:
    """Validate a mapping (e.g. parsed YAML) into a :class:`FstierConfig`."""
    if not isinstance(data, dict):
        raise ConfigError(
            f"{source or 'config'}: top level must be a mapping with tier/model/parallel, "
            f"got {type(data).__name__}"
        )
    try:
        return FstierConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, source)) from None


def load_config(path: str | os.PathLike[str]) -> FstierConfig:
    """Read and validate a YAML config file (:mod:`fstier.config_file`'s
    rules). Raises :class:`ConfigError`."""
    return parse_config(yaml_document(read_config_text(path), path), source=str(path))
