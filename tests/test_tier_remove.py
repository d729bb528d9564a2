"""FsTier.remove: named keys' files removed in one batch, with the tier's
books (lookup cache, shared usage count) in step at once, on both I/O paths."""

from __future__ import annotations

from pathlib import Path

import pytest
from manager_support import FILE_BYTES, keys, load, open_tier, store

from fstier.io import fsops
from fstier.keys import BlockKey


def test_remove_lowers_usage_and_forgets_cached_hits_at_once(tmp_path: Path) -> None:
    """Before FsTier.remove, a caller removing files beside the tier left the
    usage count high until the next capacity pass and a cached hit served for
    ``lookup_cache_ttl_s``."""
    with open_tier(tmp_path / "root", max_bytes="1GiB", lookup_cache_ttl_s=600.0) as tier:
        tier.run_capacity_pass()
        ks = keys(0, 6)
        assert store(tier, "s", ks).success
        assert tier.usage_bytes == 6 * FILE_BYTES
        tier.take_events()
        assert tier.present(ks) == [True] * 6  # cached as present for 600 s
        gone = [ks[1], ks[3], BlockKey(b"\x7f" * 16, 0)]  # the last one was never stored
        assert tier.remove(gone) == [True, True, False]
        assert tier.usage_bytes == 4 * FILE_BYTES
        assert tier.present(ks) == [True, False, True, False, True, True]
        assert not tier.mapper.path_for(ks[1]).exists() and tier.mapper.path_for(ks[2]).exists()
        assert load(tier, "l", ks[:1]).keys_completed == 1
        assert tier.remove([]) == []
        assert tier.take_events() == []  # the caller has the answer: no event
        # and a removed key stores again
        assert store(tier, "s2", [ks[1]]).success and tier.present([ks[1]]) == [True]
        assert tier.usage_bytes == 5 * FILE_BYTES


def test_remove_is_one_batch_and_checks_its_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with open_tier(tmp_path / "root") as tier:
        ks = keys(0, 4)
        assert store(tier, "s", ks).success
        unlinks: list[str] = []
        real = fsops.FS.unlink
        monkeypatch.setattr(fsops.FS, "unlink", lambda p: (unlinks.append(str(p)), real(p))[1])
        assert tier.remove(ks[:3]) == [True] * 3
        native = tier.io_path.backend == "native"
        assert unlinks == [] if native else len(unlinks) == 3
        with pytest.raises(ValueError, match="remove: keys\\[0\\]"):
            tier.remove(["nope"])  # type: ignore[list-item]
        with pytest.raises(ValueError, match="remove: keys\\[0\\]: group 5"):
            tier.remove([BlockKey(b"\x01" * 16, 5)])
        assert tier.present(ks) == [False, False, False, True]


def _in_distinct_fan_out_dirs(blocks, n: int) -> list[BlockKey]:
    """``n`` keys whose block files sit in ``n`` different fan-out directories."""
    seen: dict[Path, BlockKey] = {}
    for k in (BlockKey(bytes([j]) * 16, 0) for j in range(1, 256)):
        seen.setdefault(Path(blocks.path(k)).parent, k)
        if len(seen) == n:
            return list(seen.values())
    raise AssertionError(f"fewer than {n} fan-out directories among 255 keys")


@pytest.mark.parametrize("native_io", ["auto", "off"])
@pytest.mark.parametrize("through", ["tier", "block_store"])
def test_unreachable_keys_are_not_removed_and_the_rest_are(tmp_path: Path, native_io: str, through: str) -> None:
    """A fan-out directory that is a file (ENOTDIR) or a symlink to a copy
    outside the root (ELOOP), and a directory at a block name: those keys
    are "not removed" (False) and every other key of the batch is removed,
    on both I/O paths. Before, the Python path raised NotADirectoryError /
    ELOOP out of FsTier.remove and the batch's other keys stayed on disk
    (an LMCache ``delete`` of that batch removed nothing). Nothing outside
    the root is touched."""
    with open_tier(tmp_path / "root", native_io=native_io, lookup_cache_ttl_s=0) as tier:
        blocks = tier.blocks
        as_file, as_link, as_dir, good1, good2 = ks = _in_distinct_fan_out_dirs(blocks, 5)
        assert store(tier, "s", ks).success
        fan = Path(blocks.path(as_file)).parent
        for p in fan.iterdir():
            p.unlink()
        fan.rmdir()
        fan.write_bytes(b"a file where a fan-out directory belongs")
        link = Path(blocks.path(as_link)).parent
        outside = tmp_path / "outside"
        link.rename(outside)
        link.symlink_to(outside, target_is_directory=True)
        behind = outside / Path(blocks.path(as_link)).name
        at_name = Path(blocks.path(as_dir))
        at_name.unlink()
        at_name.mkdir()
        batch = [as_file, good1, as_link, as_dir, good2, BlockKey(b"\x7f" * 16, 0)]
        got = tier.remove(batch) if through == "tier" else blocks.remove_many(batch)
        assert got == [False, True, False, False, True, False]
        assert not Path(blocks.path(good1)).exists() and not Path(blocks.path(good2)).exists()
        assert behind.is_file() and fan.is_file() and link.is_symlink() and at_name.is_dir()
        assert tier.present([good1, good2]) == [False, False]
