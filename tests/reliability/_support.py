"""Shared helpers of the reliability suite, importable by pytest modules
(``from ._support import ...``) and by the subprocess scripts beside it
(``import _support``): a tiny deterministic model, deterministic payloads,
store/load wrappers around :mod:`fstier.io._blockio`, a fault-injecting
``FS`` replacement and the checks every test repeats (visible blocks verify,
no temp files, fd counts)."""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from fstier.config import FstierConfig, parse_config
from fstier.file_mapper import FileMapper
from fstier.io import _blockio, fsops
from fstier.io.blockfile import HEADER_SIZE, header_for_payload, padded_len
from fstier.io.blockstore import NamespaceDirs
from fstier.io.capabilities import RootCapabilities
from fstier.io.fsops import is_temp_name
from fstier.io.iotypes import (
    IOOptions,
    LoadOutcome,
    LoadRequest,
    StoreOutcome,
    StoreRequest,
    StoreStatus,
)
from fstier.io.manifest import ensure_manifest
from fstier.keys import BlockKey

#: One full-attention group, 1 layer x 1 head x 8 dims x 16 tokens x fp16:
#: a 512-byte payload, so a block file is 4096 + 4096 = 8192 bytes.
TINY_GROUP = {"kind": "full_attention", "block_size": 16, "num_layers": 1, "num_kv_heads": 1, "head_size": 8}


def tiny_config(root: Path | str, *, model: dict[str, Any] | None = None, **tier: Any) -> FstierConfig:
    """A valid config for the tiny model under ``root``; ``tier`` overrides tier fields."""
    data: dict[str, Any] = {
        "tier": {"root_dir": str(root), **tier},
        "model": {"name": "acme/tiny", "dtype": "float16", "groups": [dict(TINY_GROUP)], **(model or {})},
        "parallel": {},
    }
    return parse_config(data)


def key_for(i: int, salt: str = "") -> BlockKey:
    """A deterministic 16-byte key for integer ``i``."""
    return BlockKey(xxhash.xxh3_128(f"{salt}:{i}".encode()).digest(), 0)


def payload_for(key: BlockKey, n: int) -> bytes:
    """The deterministic content of ``key``'s block: any process can recompute
    it, so a loaded buffer is compared byte for byte against the truth."""
    seed = int.from_bytes(xxhash.xxh3_64(key.block_hash).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8).tobytes()


@dataclass
class Tier:
    """A mapper plus options: the io-level view of one namespace."""

    mapper: FileMapper
    opts: IOOptions

    @classmethod
    def open(cls, root: Path | str, *, o_direct: bool = False, fsync: str = "none", **kw: Any) -> Tier:
        cfg = tiny_config(root, **kw)
        mapper = FileMapper(cfg)
        ensure_manifest(mapper)
        # Capabilities are the root's: a test switches this root to named
        # temps with ``tier.opts.capabilities.refuse_tmpfile()``.
        caps = RootCapabilities(root=mapper.root)
        return cls(mapper, IOOptions(o_direct=o_direct, fsync=fsync, capabilities=caps))

    @property
    def payload_len(self) -> int:
        return self.mapper.expected_payload_bytes(0)

    def path(self, key: BlockKey) -> Path:
        return self.mapper.path_for(key)

    def store(self, key: BlockKey, payload: bytes | None = None) -> StoreOutcome:
        n = self.payload_len
        data = payload_for(key, n) if payload is None else payload
        path = self.path(key)
        try:
            NamespaceDirs(self.mapper).ensure(path)
        except OSError as exc:  # EMFILE and friends: a failed store, as in FsTier
            return StoreOutcome(StoreStatus.FAILED, errno.errorcode.get(exc.errno or 0, "OSError"))
        buf = fsops.aligned_buffer(n)
        buf[:n] = data
        header = header_for_payload(key, self.mapper.digest_bytes, data, 1, n)
        return _blockio.store_block(StoreRequest(path, header, buf), self.opts)

    def load(self, key: BlockKey, path: Path | None = None) -> tuple[LoadOutcome, bytes]:
        n = self.payload_len
        buf = fsops.aligned_buffer(n)
        req = LoadRequest(path or self.path(key), buf, key, self.mapper.digest_bytes, n)
        out = _blockio.load_block(req, self.opts)
        return out, bytes(buf[:n])

    def file_bytes(self, key: BlockKey) -> bytes:
        """The exact bytes a valid block file of ``key`` holds (header + padded payload)."""
        return self.path(key).read_bytes()


@dataclass
class Tally:
    """Counters a test publishes (docs/reliability.md figures)."""

    tried: int = 0
    detected: int = 0
    loaded_ok: int = 0
    wrong_bytes: int = 0

    def check_load(self, out: LoadOutcome, got: bytes, want: bytes) -> None:
        """A load of a damaged file: it must not be LOADED unless the bytes are right."""
        self.tried += 1
        if out.status == "LOADED":
            if got == want:
                self.loaded_ok += 1
            else:
                self.wrong_bytes += 1
        else:
            self.detected += 1


def iter_files(root: Path) -> Iterator[Path]:
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            yield Path(dirpath) / f


def temp_files(root: Path) -> list[Path]:
    return [p for p in iter_files(root) if is_temp_name(p.name)]


def block_files(root: Path) -> list[Path]:
    return [p for p in iter_files(root) if p.name.endswith(".bin") and not is_temp_name(p.name)]


def fd_count() -> int:
    """Open fds of this process. Tests compare with ``<=``: background threads
    of earlier tests may close fds meanwhile, but a leak can only add one."""
    return len(os.listdir("/proc/self/fd"))


def header_size_file(n: int) -> int:
    return HEADER_SIZE + padded_len(n)


def oserror(code: int) -> OSError:
    return OSError(code, os.strerror(code))


@dataclass
class FaultyOps(fsops.OsOps):
    """A drop-in ``fsops.FS`` whose methods can be wrapped per test.

    ``hooks[name]`` is called as ``hook(real, *args)`` instead of the real
    method ``real``; ``calls`` counts every call by name (thread-safe)."""

    hooks: dict[str, Callable[..., Any]] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __getattribute__(self, name: str) -> Any:
        attr = object.__getattribute__(self, name)
        if name.startswith("_") or name in ("hooks", "calls") or not callable(attr):
            return attr
        hooks = object.__getattribute__(self, "hooks")
        with object.__getattribute__(self, "_lock"):
            calls = object.__getattribute__(self, "calls")
            calls[name] = calls.get(name, 0) + 1
        hook = hooks.get(name)
        if hook is None:
            return attr
        return lambda *a, **k: hook(attr, *a, **k)


def raise_errno(code: int) -> Callable[..., Any]:
    def hook(_real: Callable[..., Any], *_a: Any, **_k: Any) -> Any:
        raise oserror(code)

    return hook


ENOSPC, EIO, EXDEV, ESTALE, EMFILE, EACCES = (
    errno.ENOSPC,
    errno.EIO,
    errno.EXDEV,
    errno.ESTALE,
    errno.EMFILE,
    errno.EACCES,
)
