"""The C engine formats each file's name itself (``engine_submit`` with no
paths): its names are the one path codec's, ``fstier.file_mapper.encode``,
for every hash length, many hashes and every group range; a bad key is one
clear error, never a name."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
from manager_support import keys, open_tier, store

from fstier.file_mapper import encode
from fstier.io import native
from fstier.keys import MAX_HASH_BYTES, MIN_HASH_BYTES, BlockKey

ext = native._ext
pytestmark = pytest.mark.skipif(
    ext is None or not hasattr(ext, "engine_names"), reason="fstier's native extension (with the engine) is not built"
)


def test_c_names_are_the_codecs_for_many_keys_and_groups() -> None:
    rng = random.Random(41)
    ks = [
        BlockKey(rng.randbytes(n), g)
        for n in range(MIN_HASH_BYTES, MAX_HASH_BYTES + 1)
        for g in (0, 1, 9, 10, 255, 4096, 65535, rng.randrange(65536))
    ]
    ks += [BlockKey(rng.randbytes(16), rng.randrange(4)) for _ in range(4000)]
    ks += [BlockKey(bytes([b]) * 8, 0) for b in (0x00, 0x0F, 0xA0, 0xFF)]  # leading zeros and high nibbles
    got = ext.engine_names([k.block_hash for k in ks], tuple(k.group_idx for k in ks))
    assert got == [os.fsencode(encode(k)) for k in ks]


@pytest.mark.parametrize(
    ("hashes", "groups", "error"),
    [
        ([b"x" * 7], [0], ValueError),  # too short a hash
        ([b"x" * 65], [0], ValueError),  # too long
        (["a" * 16], [0], ValueError),  # not bytes
        ([b"x" * 16], [65536], ValueError),  # group out of range
        ([b"x" * 16], [-1], ValueError),
        ([b"x" * 16], ["0"], ValueError),  # not an int
        ([b"x" * 16], [0, 1], ValueError),  # lengths differ
        (iter([b"x" * 16]), [0], TypeError),  # not a list or tuple
    ],
)
def test_a_bad_key_is_an_error_not_a_name(hashes: object, groups: object, error: type[Exception]) -> None:
    with pytest.raises(error):
        ext.engine_names(hashes, groups)


def test_the_native_engine_stores_each_key_at_its_codec_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """End to end: a job submitted with no paths lands every file where the
    mapper names it, and a load finds it there."""
    monkeypatch.setenv("FSTIER_ENGINE", "native")
    if native.status("auto").backend != "native":
        pytest.skip("the native I/O path is not in use here (FSTIER_NATIVE=0)")
    with open_tier(tmp_path / "root") as tier:
        assert tier._engine.engine.backend == "native"
        ks = keys(0, 12)
        res = store(tier, "s", ks)
        assert res.success and res.keys_completed == 12
        assert all(Path(tier.blocks.path(k)).is_file() for k in ks)
        assert sorted(p.name for p in (tmp_path / "root").rglob("*.bin")) == sorted(
            encode(k).rpartition("/")[2] for k in ks
        )
