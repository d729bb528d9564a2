"""The native path's O_TMPFILE refusal belongs to the root that refused.

Issue 23: filesystem capabilities are probed per root, never per process. A
root whose filesystem refuses ``O_TMPFILE`` (NFS, FUSE: EOPNOTSUPP; a kernel
without it: EISDIR) publishes through named temps from then on; every other
root in the process keeps ``O_TMPFILE`` + ``linkat``. The native extension
reports a refusal per block and :func:`fstier.io.native.store_batch` records
it in that root's :class:`~fstier.io.capabilities.RootCapabilities`.

Real files, the extension's own fault seam (``native.fault``): the refusal is
an injected EOPNOTSUPP on the O_TMPFILE open, and which publication ran is
read from the seam's call counts (``link``: the anonymous inode was linked;
``rename``: a named temp was renamed over the name).
"""

from __future__ import annotations

import errno
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from fstier.io import native
from fstier.io.blockfile import padded_len
from fstier.io.capabilities import RootCapabilities
from fstier.io.fsops import O_TMPFILE, aligned_buffer, is_temp_name
from fstier.io.iotypes import IOOptions, StoreStatus
from fstier.keys import BlockKey

sys.path.insert(0, str(Path(__file__).parent))
import io_worker  # noqa: E402
from manager_support import key as tier_key  # noqa: E402
from manager_support import load as tier_load  # noqa: E402
from manager_support import open_tier  # noqa: E402
from manager_support import store as tier_store  # noqa: E402

pytestmark = [
    pytest.mark.skipif(native._ext is None, reason=f"native extension not built: {native._import_error}"),
    pytest.mark.skipif(not O_TMPFILE, reason="this platform has no O_TMPFILE"),
]

DIGEST = io_worker.DIGEST
N = io_worker.PAYLOAD


@pytest.fixture(autouse=True)
def _disarm() -> Iterator[None]:
    native.clear_faults()
    yield
    native.clear_faults()


def _root(tmp_path: Path, name: str) -> tuple[Path, RootCapabilities]:
    root = tmp_path / name
    (root / "sub").mkdir(parents=True)
    return root, RootCapabilities(root=root)


def _path(root: Path, key: BlockKey) -> Path:
    return root / "sub" / f"{key.hex}-g{key.group_idx}.bin"


def _store(root: Path, keys: list[BlockKey], caps: RootCapabilities | None) -> None:
    """One native call storing ``keys`` under ``root``; every key must be STORED."""
    bufs = []
    for k in keys:
        buf = aligned_buffer(padded_len(N))
        buf[:N] = io_worker.payload_of(k, 0)
        bufs.append(buf[:N])
    out = native.store_batch(
        str(root), [str(_path(root, k)) for k in keys], keys, bufs, DIGEST, 1,
        IOOptions(capabilities=caps),
    )
    assert [o.status for o in out] == [StoreStatus.STORED] * len(keys), out


def _loads_back(root: Path, keys: list[BlockKey]) -> bool:
    bufs = [aligned_buffer(padded_len(N)) for _ in keys]
    out = native.load_batch(
        str(root), [str(_path(root, k)) for k in keys], keys, [b[:N] for b in bufs], DIGEST, IOOptions()
    )
    return all(o.ok for o in out) and all(
        bytes(b[:N]) == io_worker.payload_of(k, 0) for b, k in zip(bufs, keys, strict=True)
    )


def _count_from_now() -> None:
    """Reset the seam's counters and arm a rule that never fires (the seam
    counts calls only while a rule is armed)."""
    native.clear_faults()
    native.fault("unlink", times=0)


def _publications() -> dict[str, int]:
    return {op: native.fault_count(op) for op in ("open", "link", "rename")}


def _temps(root: Path) -> list[str]:
    return [p.name for p in root.rglob("*") if is_temp_name(p.name)]


@pytest.mark.parametrize("code", [errno.EOPNOTSUPP, errno.EISDIR], ids=["EOPNOTSUPP", "EISDIR"])
def test_a_refusal_switches_its_root_and_no_other(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, code: int
) -> None:
    nfs, caps_nfs = _root(tmp_path, "nfs")
    local, caps_local = _root(tmp_path, "local")
    k1, k2, k3 = (io_worker.key_of(i) for i in (1, 2, 3))

    native.fault("open", code, times=1)  # the first open of the store: its O_TMPFILE inode
    with caplog.at_level(logging.INFO, logger="fstier.io"):
        _store(nfs, [k1], caps_nfs)
    # refused, then published through a named temp, and the root remembers
    assert _publications() == {"open": 2, "link": 0, "rename": 1}
    assert not caps_nfs.tmpfile and caps_local.tmpfile
    said = [r.getMessage() for r in caplog.records if "O_TMPFILE unavailable" in r.getMessage()]
    assert len(said) == 1 and str(nfs) in said[0] and errno.errorcode[code] in said[0]

    _count_from_now()
    _store(local, [k1, k2], caps_local)
    # the other root in the same process still links O_TMPFILE inodes
    assert _publications() == {"open": 2, "link": 2, "rename": 0}
    assert caps_local.tmpfile

    _count_from_now()
    _store(nfs, [k2, k3], caps_nfs)
    # the refusing root no longer tries O_TMPFILE at all: one open per block
    assert _publications() == {"open": 2, "link": 0, "rename": 2}

    assert _loads_back(nfs, [k1, k2, k3]) and _loads_back(local, [k1, k2])
    assert _temps(nfs) == [] and _temps(local) == []


def test_the_first_refusal_switches_the_rest_of_its_call(tmp_path: Path) -> None:
    root, caps = _root(tmp_path, "nfs")
    keys = [io_worker.key_of(i) for i in range(1, 5)]
    native.fault("open", errno.EOPNOTSUPP, times=1)
    _store(root, keys, caps)
    # one refused O_TMPFILE open, then a named temp for each of the 4 blocks
    assert _publications() == {"open": 5, "link": 0, "rename": 4}
    assert not caps.tmpfile
    assert _loads_back(root, keys) and _temps(root) == []


def test_a_call_without_capabilities_falls_back_for_that_call_only(tmp_path: Path) -> None:
    """A bare call has no root to remember the refusal in: it publishes its
    own blocks through named temps, and the next bare call tries O_TMPFILE
    again (as the Python path's bare ``store_block`` does)."""
    root, _caps = _root(tmp_path, "bare")
    k1, k2 = io_worker.key_of(1), io_worker.key_of(2)
    native.fault("open", errno.EOPNOTSUPP, times=1)
    _store(root, [k1], None)
    assert _publications() == {"open": 2, "link": 0, "rename": 1}
    _count_from_now()
    _store(root, [k2], None)
    assert _publications() == {"open": 1, "link": 1, "rename": 0}
    assert _loads_back(root, [k1, k2])


def test_another_error_on_the_tmpfile_open_is_not_a_refusal(tmp_path: Path) -> None:
    """EACCES says nothing about O_TMPFILE: the store fails, the root keeps it."""
    root, caps = _root(tmp_path, "local")
    k1 = io_worker.key_of(1)
    native.fault("open", errno.EACCES, times=1)
    out = native.store_batch(
        str(root), [str(_path(root, k1))], [k1], [aligned_buffer(padded_len(N))[:N]], DIGEST, 1,
        IOOptions(capabilities=caps),
    )
    assert out[0].status is StoreStatus.FAILED and out[0].cause == "EACCES"
    assert caps.tmpfile and _temps(root) == [] and not _path(root, k1).exists()
    _count_from_now()
    _store(root, [k1], caps)
    assert _publications() == {"open": 1, "link": 1, "rename": 0}


def test_two_tiers_in_one_process_keep_their_own_publication(tmp_path: Path) -> None:
    """End to end through FsTier: the tier whose root refused O_TMPFILE
    stores through named temps; a second tier on another root in the same
    process keeps O_TMPFILE."""
    with open_tier(tmp_path / "nfs", native_io="on") as nfs, open_tier(tmp_path / "local", native_io="on") as local:
        if nfs.io_path.backend != "native":
            pytest.skip(f"the tier runs the Python path ({nfs.io_path.reason})")
        # the first key makes the fan-out directory every later key shares
        assert tier_store(nfs, "warm-nfs", [tier_key(0)]).success
        assert tier_store(local, "warm-local", [tier_key(0)]).success
        native.fault("open", errno.EOPNOTSUPP, times=1)
        assert tier_store(nfs, "nfs-1", [tier_key(1)]).success
        assert native.fault_count("rename") == 1 and native.fault_count("link") == 0
        caps_nfs, caps_local = nfs.io_options.capabilities, local.io_options.capabilities
        assert caps_nfs is not None and caps_local is not None
        assert not caps_nfs.tmpfile and caps_local.tmpfile

        _count_from_now()
        assert tier_store(local, "local-2", [tier_key(2), tier_key(3)]).success
        assert native.fault_count("link") == 2 and native.fault_count("rename") == 0
        _count_from_now()
        assert tier_store(nfs, "nfs-2", [tier_key(2), tier_key(3)]).success
        assert native.fault_count("link") == 0 and native.fault_count("rename") == 2

        assert tier_load(nfs, "nfs-load", [tier_key(i) for i in range(4)]).success
        assert tier_load(local, "local-load", [tier_key(i) for i in (0, 2, 3)]).success
    leftovers = [n for r in ("nfs", "local") for _, _, fs in os.walk(tmp_path / r) for n in fs if is_temp_name(n)]
    assert leftovers == []
