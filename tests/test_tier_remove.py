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
