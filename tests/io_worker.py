"""Subprocess worker for the multi-process io tests (run as a script).

``store ROOT NKEYS ROUNDS SEED``: store the same NKEYS keys ROUNDS times,
unlinking each final file first so that writers really race on rename.
``replace ROOT SECONDS``: publish new complete versions of one key over the
final path with os.replace as fast as possible, for SECONDS.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import contextlib

from fstier.io._blockio import store_block  # noqa: E402
from fstier.io.blockfile import encode_header, header_for_payload, padded_len  # noqa: E402
from fstier.io.fsops import (
    aligned_buffer,  # noqa: E402
    temp_path_for,  # noqa: E402
)
from fstier.io.iotypes import IOOptions, StoreRequest  # noqa: E402
from fstier.keys import BlockKey  # noqa: E402

DIGEST = b"\x5a" * 8
PAYLOAD = 3 * 4096 + 100


def key_of(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(4, "little") * 4, 0)


def path_of(root: Path, key: BlockKey) -> Path:
    return root / f"{key.hex}-g{key.group_idx}.bin"


def payload_of(key: BlockKey, version: int) -> bytes:
    """A deterministic payload that names its key and version in its first bytes."""
    head = key.block_hash[:8] + version.to_bytes(8, "little")
    return (head * (PAYLOAD // len(head) + 1))[:PAYLOAD]


def store_loop(root: Path, nkeys: int, rounds: int, seed: int) -> None:
    opts = IOOptions(o_direct=True)
    slot = aligned_buffer(padded_len(PAYLOAD))
    for r in range(rounds):
        for i in range(nkeys):
            key = key_of(i)
            path = path_of(root, key)
            if (r + i + seed) % 2:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            data = payload_of(key, seed * 1_000_000 + r)
            slot[:PAYLOAD] = data
            header = header_for_payload(key, DIGEST, data, 1, PAYLOAD)
            out = store_block(StoreRequest(path, header, slot), opts)
            if out.status.value == "FAILED":
                print(f"store failed: {out}", file=sys.stderr)
                sys.exit(1)


def replace_loop(root: Path, seconds: float) -> None:
    key = key_of(7)
    final = path_of(root, key)
    end = time.monotonic() + seconds
    version = 0
    while time.monotonic() < end:
        version += 1
        data = payload_of(key, version)
        header = header_for_payload(key, DIGEST, data, 1, PAYLOAD)
        blob = encode_header(header) + data + bytes(padded_len(PAYLOAD) - PAYLOAD)
        tmp = temp_path_for(final)
        with open(tmp, "wb") as f:
            f.write(blob)
        os.replace(tmp, final)
    print(version)


if __name__ == "__main__":
    cmd, root = sys.argv[1], Path(sys.argv[2])
    if cmd == "store":
        store_loop(root, int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    elif cmd == "replace":
        replace_loop(root, float(sys.argv[3]))
    else:
        raise SystemExit(f"unknown command {cmd!r}")
