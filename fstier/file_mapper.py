"""Naming: block keys to file paths, under a namespace that digests every
byte-changing field. Pure naming: nothing here opens a file descriptor or
does block I/O (directories, manifests and blocks are written by
:mod:`fstier.io`); ``path_for`` costs one string format and one ``Path``
join (the hot paths use :meth:`fstier.io.blockstore.BlockStore.path`, a
string).

Layout on disk (see docs/format.md)::

    <root>/<safe_model_name>-<digest16>/config.json           manifest
    <root>/<safe_model_name>-<digest16>/[r<rank>/]<hex[:3]>/<hash hex>-g<group>.bin

The digest is the first 16 hex chars of sha256 over the canonical JSON
(sorted keys, no spaces) of :meth:`FileMapper.namespace_fields`. When the
model is parallel-agnostic (:func:`is_parallel_agnostic`) tp/pp/pcp/dcp are
written as 1 and there is no rank segment (:func:`parallel_identity`, the
one collapse rule, also used by engine-defined namespaces), so every parallel layout of the
same model shares one directory; otherwise they stay in the digest and each
rank has its own ``r<rank>`` subtree.

An engine that owns its byte layout (vLLM's offloading rows) defines the
namespace itself: :meth:`FileMapper.for_engine` digests the engine's fields
and follows the engine's parallel-agnostic verdict, with the same layout.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Sequence
from itertools import repeat
from operator import attrgetter, getitem
from pathlib import Path
from typing import Any

from fstier.canonical import canonical_format_id, canonical_page_bytes, is_certified
from fstier.config import FstierConfig, ModelSpec, ParallelSpec
from fstier.errors import FstierError, PathSafetyError
from fstier.keys import BlockKey

__all__ = [
    "BLOCK_NAME_RE",
    "BLOCK_SUFFIX",
    "MANIFEST_NAME",
    "NAMESPACE_NAME_RE",
    "NAMESPACE_VERSION",
    "FileMapper",
    "canonical_json",
    "decode",
    "encode",
    "encode_many",
    "is_namespace_name",
    "is_parallel_agnostic",
    "parallel_identity",
    "safe_model_name",
]

#: Version of the namespace layout (manifest and directory fan-out). 2: one
#: fan-out level of 4096 directories, ``<hex[:3]>/<hex>-g<group>.bin`` (format
#: v2; v1 had ``<hex[:3]>/<hex[3:5]>/``, one new leaf directory per store at
#: cache sizes below ~10^7 files). It is digested, so a v1 namespace is
#: another directory: foreign to this version (``fstier inspect`` names it,
#: ``fstier gc --remove-foreign`` removes it).
NAMESPACE_VERSION = 2
#: Hex characters of the key hash that name its fan-out directory (16^3 = 4096).
FANOUT_HEX = 3
BLOCK_SUFFIX = ".bin"
#: The namespace manifest's file name, in the namespace directory.
MANIFEST_NAME = "config.json"
#: A block file's name, as :meth:`FileMapper.path_for` writes it: the key's
#: hash in hex (8..64 bytes) and its group.
BLOCK_NAME_RE = re.compile(r"^([0-9a-f]{16,128})-g([0-9]{1,5})\.bin$")
#: THE namespace-directory rule: ``<safe model name, at most 64
#: characters>-<16 hex digits>``, how :class:`FileMapper` names a namespace
#: (inspect, verify, gc and the CLI's ROOT check all ask
#: :func:`is_namespace_name`).
NAMESPACE_NAME_RE = re.compile(r"^.{1,64}-[0-9a-f]{16}$")
_MAX_NAME = 64
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def is_parallel_agnostic(model: ModelSpec, parallel: ParallelSpec) -> bool:
    """True only for exactly one KV group of kind ``full_attention`` (hence not
    MLA, not sliding window, not mamba) on a model runner other than ``v2``,
    whose pages this layout can map onto the canonical page (heads shard or
    replicate evenly, the block splits evenly over context-parallel ranks).
    See docs/parallel-agnostic.md for why each exclusion exists."""
    if len(model.groups) != 1:
        return False
    group = model.groups[0]
    return (
        group.kind == "full_attention"
        and parallel.model_runner != "v2"
        # Without a certified mapping the pages are rank-private: two layouts
        # with equal world size would share files they cannot read correctly.
        and is_certified(group, parallel)
    )


def parallel_identity(agnostic: bool, sizes: dict[str, int]) -> dict[str, int]:
    """THE collapse rule of a parallel-agnostic namespace, for YAML configs
    and engines alike: each parallel size in ``sizes`` (``tp_size``,
    ``pp_size``, ...) is digested as given, or as 1 when ``agnostic``, so
    every parallel layout of the model shares one directory. The rank leaves
    the path under the same verdict (:class:`FileMapper` puts no ``r<rank>``
    segment in an agnostic namespace)."""
    return {name: 1 if agnostic else size for name, size in sizes.items()}


def safe_model_name(name: str) -> str:
    """One safe path component: ``/`` and anything outside ``[A-Za-z0-9._-]``
    become ``_``, a leading ``.`` becomes ``_``, at most 64 characters."""
    safe = _UNSAFE.sub("_", name)[:_MAX_NAME]
    if safe.startswith("."):
        safe = "_" + safe[1:]
    return safe or "model"


def is_namespace_name(name: str) -> bool:
    """Whether ``name`` is a namespace directory's name (:data:`NAMESPACE_NAME_RE`)."""
    return NAMESPACE_NAME_RE.match(name) is not None


# ------------------------------------------------------------- the path codec
_HASH = attrgetter("block_hash")
_GROUP = attrgetter("group_idx")
_FANOUT = slice(0, FANOUT_HEX)
_NAME_FORMAT = "{}{}/{}-g{}" + BLOCK_SUFFIX


def encode(key: BlockKey) -> str:
    """THE path codec, key -> file: ``key``'s block file relative to the
    namespace's blocks directory, ``<hex[:3]>/<hex>-g<group>.bin`` (format
    v2: one fan-out level of 4096 directories, the group in the name;
    docs/format.md section 1). A string: it is on every store's and
    lookup's path, where ``pathlib`` costs more than the rest."""
    h = key.block_hash.hex()
    return f"{h[:FANOUT_HEX]}/{h}-g{key.group_idx}{BLOCK_SUFFIX}"


def encode_many(keys: Sequence[BlockKey], prefix: str = "") -> list[str]:
    """``[prefix + encode(k) for k in keys]`` with no bytecode per key (the
    same format string, applied by ``map``): a store or load batch names all
    its files with it (test_file_mapper.py::test_encode_many_is_encode)."""
    hexes = list(map(bytes.hex, map(_HASH, keys)))
    return list(map(
        _NAME_FORMAT.format, repeat(prefix), map(getitem, hexes, repeat(_FANOUT)), hexes, map(_GROUP, keys)
    ))


def decode(name: str) -> BlockKey | None:
    """THE path codec, file -> key: the key a block file's name holds, or
    None for any name :func:`encode` does not write. ``name`` is a file name,
    or a path relative to the blocks directory, which must then be exactly
    where :func:`encode` puts that key (a misplaced block name is None)."""
    dirs, _, base = name.rpartition("/")
    m = BLOCK_NAME_RE.match(base)
    if m is None or len(m.group(1)) % 2:
        return None
    try:
        key = BlockKey(bytes.fromhex(m.group(1)), int(m.group(2)))
    except (ValueError, FstierError):  # a hash length or group BlockKey refuses
        return None
    if dirs and encode(key) != name:
        return None
    return key


def canonical_json(obj: Any) -> bytes:
    """Sorted keys, no spaces, ASCII: what the namespace digest is taken over."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


class FileMapper:
    """Maps :class:`BlockKey` to paths for one (model, parallel layout, tier) config."""

    def __init__(self, config: FstierConfig) -> None:
        self.config: FstierConfig | None = config
        self._setup(
            Path(config.tier.root_dir),
            config.model.name,
            is_parallel_agnostic(config.model, config.parallel),
            config.parallel.rank,
            self.namespace_fields(),
            [
                config.tier.blocks_per_file * canonical_page_bytes(g, config.parallel)
                for g in config.model.groups
            ],
        )

    @classmethod
    def for_engine(
        cls,
        root_dir: str | os.PathLike[str],
        model_name: str,
        fields: dict[str, Any],
        *,
        agnostic: bool,
        rank: int,
        payload_bytes: list[int],
    ) -> FileMapper:
        """A mapper whose namespace an engine defines (e.g. vLLM's offloading
        config, :mod:`fstier.integrations.vllm`) instead of a :class:`ModelSpec`.

        ``fields`` is digested as given (it must already hold every field that
        changes a file's bytes, its parallel sizes passed through
        :func:`parallel_identity`); ``payload_bytes[g]`` is the payload length of group
        ``g``'s files. The on-disk layout and manifest are the same as for a
        config-built mapper; :attr:`config` is ``None``."""
        if not isinstance(rank, int) or rank < 0:
            raise ValueError(f"FileMapper.for_engine: rank must be an int >= 0, got {rank!r}")
        if not payload_bytes or any(n <= 0 for n in payload_bytes):
            raise ValueError(
                f"FileMapper.for_engine: payload_bytes must list one size > 0 per group, "
                f"got {payload_bytes!r}"
            )
        self = cls.__new__(cls)
        self.config = None
        self._setup(
            Path(root_dir), model_name, agnostic, rank,
            {"namespace_version": NAMESPACE_VERSION, **fields}, list(payload_bytes),
        )
        return self

    def _setup(
        self,
        root: Path,
        model_name: str,
        agnostic: bool,
        rank: int,
        fields: dict[str, Any],
        payload_bytes: list[int],
    ) -> None:
        # The real path: block paths are then free of symlinks by
        # construction, and every later resolution refuses any symlink it
        # meets (fstier/io/fsops.py), planted below the root or not.
        self.root = Path(os.path.realpath(root))
        self.agnostic = agnostic
        self.fields = fields
        self._payload_bytes = payload_bytes
        self.digest = hashlib.sha256(canonical_json(self.fields)).hexdigest()[:16]
        self.digest_bytes = bytes.fromhex(self.digest)
        self.namespace = f"{safe_model_name(model_name)}-{self.digest}"
        self.namespace_dir = self.root / self.namespace
        self.blocks_dir = self.namespace_dir if self.agnostic else self.namespace_dir / f"r{rank}"

    @property
    def num_groups(self) -> int:
        """Number of KV groups (valid ``BlockKey.group_idx`` values)."""
        return len(self._payload_bytes)

    # -- namespace -------------------------------------------------------
    def namespace_fields(self) -> dict[str, Any]:
        """Every field that changes the bytes of a block file, as digested."""
        cfg = self.config
        if cfg is None:  # an engine-defined namespace (for_engine)
            return dict(self.fields)
        model, par = cfg.model, cfg.parallel
        agnostic = is_parallel_agnostic(model, par)
        groups = [
            {
                "kind": g.kind,
                "block_size": g.block_size,
                "num_layers": g.num_layers,
                "num_kv_heads": g.num_kv_heads,
                "head_size": g.head_size,
                "dtype": g.dtype,
                "kv_layout": g.kv_layout,
                "sliding_window": g.sliding_window,
                "page_size_bytes": g.page_size_bytes,
                "page_bytes": g.page_bytes,
                "file_page_bytes": canonical_page_bytes(g, par),
                "format_id": canonical_format_id(g),
            }
            for g in model.groups
        ]
        return {
            "namespace_version": NAMESPACE_VERSION,
            "model": model.name,
            "revision": model.revision,
            "dtype": model.dtype,
            "groups": groups,
            "blocks_per_file": cfg.tier.blocks_per_file,
            "format_id": "+".join(str(g["format_id"]) for g in groups),
            **parallel_identity(
                agnostic,
                {
                    "tp_size": par.tp_size,
                    "pp_size": par.pp_size,
                    "pcp_size": par.pcp_size,
                    "dcp_size": par.dcp_size,
                    "cp_kv_cache_interleave_size": par.cp_kv_cache_interleave_size,
                },
            ),
            "model_runner": par.model_runner,
            "namespace_salt": cfg.tier.namespace_salt,
        }

    def manifest(self) -> dict[str, Any]:
        """The content of ``config.json``: the digested fields plus identity."""
        return {
            "fstier_manifest": NAMESPACE_VERSION,
            "namespace": self.namespace,
            "digest": self.digest,
            "parallel_agnostic": self.agnostic,
            "fields": self.fields,
        }

    # -- paths ------------------------------------------------------------
    def expected_payload_bytes(self, group_idx: int) -> int:
        """Payload length of a full file of group ``group_idx``."""
        return self._payload_bytes[group_idx]

    def path_for(self, key: BlockKey) -> Path:
        """The final path of ``key``'s block file (one fan-out level of 4096
        directories, :func:`encode`)."""
        if key.group_idx >= self.num_groups:
            raise PathSafetyError(
                f"key group {key.group_idx} does not exist; the model has "
                f"{self.num_groups} group(s)"
            )
        return self.blocks_dir / encode(key)
