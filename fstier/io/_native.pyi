"""Type stub of the C extension fstier/io/_native.c (see fstier/io/native.py)."""

from collections.abc import Sequence
from typing import Any

F_CHECKSUM: int
F_DIRECT: int
F_FSYNC_FILE: int
F_FSYNC_DIR: int
F_MKDIR: int
F_NO_TMPFILE: int

def store_batch(
    base: bytes,
    rels: Sequence[bytes],
    hashes: Sequence[bytes],
    groups: Sequence[int],
    payloads: Sequence[Any],
    digest: bytes,
    page_count: int,
    flags: int,
    mode: int,
    created_ns: int,
    alignment: int,
    helpers: int = ...,
    /,
) -> list[tuple[int, int, int, int, int]]: ...
def load_batch(
    base: bytes,
    rels: Sequence[bytes],
    hashes: Sequence[bytes],
    groups: Sequence[int],
    buffers: Sequence[Any],
    digest: bytes,
    flags: int,
    alignment: int,
    helpers: int = ...,
    eager: int = ...,
    /,
) -> list[tuple[int, int, int, int, int, int]]: ...
def lookup_batch(base: bytes, rels: Sequence[bytes], prefix: bool, cached: bool = ..., /) -> bytes: ...
def lookup_within(
    base: bytes, rels: Sequence[bytes], prefix: bool, timeout_s: float, cached: bool = ..., /
) -> bytes | None: ...
def lookup_stuck() -> int: ...
def fan_started() -> int: ...
def touch_batch(base: bytes, rels: Sequence[bytes], /) -> bytes: ...
def remove_batch(base: bytes, rels: Sequence[bytes], /) -> bytes: ...
def xxh3_64(buf: Any, /) -> int: ...
def xxh3_64_impl(buf: Any, impl: int, /) -> int: ...
def crc32c(buf: Any, hw: bool = ..., /) -> int: ...
def checksum_bench(buf: Any, kind: int, reps: int, /) -> tuple[float, int]: ...
def fault_set(
    op: str,
    err: int = ...,
    nth: int = ...,
    times: int = ...,
    delay_s: float = ...,
    short: int = ...,
    after: bool = ...,
) -> None: ...
def fault_clear() -> None: ...
def fault_count(op: str, /) -> int: ...
def configure(
    host: str | None = ..., openat2: int = ..., tmpfile: int = ..., format_version: int = ...
) -> dict[str, Any]: ...

# -- the job engine (_native_engine.c) ---------------------------------------
def engine_new(read_threads: int, write_threads: int, /) -> Any: ...
def engine_submit(
    engine: Any,
    tag: int,
    kind: int,
    base: bytes,
    rels: Sequence[bytes],
    hashes: Sequence[bytes],
    groups: Sequence[int],
    buffers: Sequence[Any],
    replace: Sequence[bool] | None,
    digest: bytes,
    pages: int,
    flags: int,
    mode: int,
    created_ns: int,
    alignment: int,
    timeout_s: float,
    spread: int = ...,
    notify_fd: int = ...,
    record: Any = ...,
    /,
) -> None: ...
def engine_collect(engine: Any, /) -> list[tuple[Any, ...]]: ...
def engine_wait(engine: Any, timeout_s: float, /) -> bool: ...
def engine_fd(engine: Any, /) -> int: ...
def engine_clock(engine: Any, now_s: float | None = ..., /) -> float: ...
def engine_info(engine: Any, /) -> dict[str, int]: ...
def engine_cancel(engine: Any, tag: int, /) -> bool: ...
def engine_shutdown(engine: Any, timeout_s: float, /) -> bool: ...
def engine_touch(
    engine: Any, tag: int, base: bytes, rels: Sequence[bytes], timeout_s: float, record: Any = ..., /
) -> None: ...
def engine_namespace(
    engine: Any, base: bytes, root: bytes, ns: bytes, rest: bytes, manifest_name: bytes, manifest: bytes, /
) -> bool: ...
