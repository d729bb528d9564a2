"""Two hosts on one real shared filesystem (GlusterFS, MooseFS): what host a
stores, host b finds and loads byte-exact; both storing the same keys at once;
eviction on one host while the other loads; the CLI from the other host."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

from manager_support import keys, load, open_tier, store, temp_files

from .conftest import SharedFs

FSTIER = [sys.executable, "-m", "fstier.cli"]


def test_store_on_a_loads_byte_exact_on_b(sfs: SharedFs) -> None:
    ks = keys(0, 48)
    with open_tier(sfs.a) as a:
        res = store(a, "s", ks)
        assert res.success and res.keys_completed == len(ks), res
    with open_tier(sfs.b) as b:
        assert b.lookup(ks) == len(ks)
        res = load(b, "l", ks)  # load() checks every loaded slot's bytes
        assert res.success and res.keys_completed == len(ks), res


def test_both_hosts_store_the_same_keys_at_once(sfs: SharedFs) -> None:
    ks = keys(100, 40)
    with open_tier(sfs.a) as a, open_tier(sfs.b) as b:
        results = {}

        def run(name: str, tier) -> None:  # type: ignore[no-untyped-def]
            for rnd in range(3):
                results[(name, rnd)] = store(tier, f"{name}{rnd}", ks)

        threads = [threading.Thread(target=run, args=(n, t)) for n, t in (("a", a), ("b", b))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads)
        assert all(r.success for r in results.values()), results
        # Right after the race a host may still open a name it cached before
        # the other host's rename replaced it (GlusterFS keeps entries and
        # attributes ~1 s: "rename-replace seen by a new open on b" in the
        # semantics figures): such a key is a miss, never wrong bytes (load()
        # checks every loaded key's bytes).
        for name, tier in (("a", a), ("b", b)):
            res = load(tier, f"early{name}", ks)
            assert res.success or res.cause == "miss", (name, res)
        # Past the mount's caches each host loads every key byte-exact,
        # whoever's rename won.
        time.sleep(2.0)
        for name, tier in (("a", a), ("b", b)):
            res = load(tier, f"l{name}", ks)
            assert res.success and res.keys_completed == len(ks), (name, res)
    assert temp_files(sfs.a) == []


def test_eviction_on_a_while_b_loads(sfs: SharedFs) -> None:
    """Host a evicts most of the root while host b loads the same keys in a
    loop: every load is byte-exact for its loaded prefix (load() checks it)
    and a key that vanished is a miss, never a device error."""
    ks = keys(200, 64)
    with open_tier(sfs.a, max_bytes=1 << 30) as a:
        res = store(a, "s", ks)
        assert res.success
        stop = threading.Event()
        causes: list[str | None] = []
        errors: list[BaseException] = []

        def loads() -> None:
            try:
                with open_tier(sfs.b) as b:
                    i = 0
                    while not stop.is_set():
                        r = load(b, f"l{i}", ks)
                        i += 1
                        if not r.success:
                            causes.append(r.cause)
                        if r.keys_completed == 0:
                            return  # everything is gone
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        t = threading.Thread(target=loads)
        t.start()
        try:
            rep = a.run_capacity_pass(max_bytes=8 * 8192)
            assert rep.removed_files > 0
        finally:
            stop.set()
            t.join(120)
        assert not t.is_alive()
        assert errors == [], errors
        assert all(c in (None, "miss") for c in causes), causes


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*FSTIER, *args], capture_output=True, text=True, timeout=180)


def test_cli_from_the_other_host(sfs: SharedFs) -> None:
    ks = keys(300, 24)
    with open_tier(sfs.a) as a:
        assert store(a, "s", ks).success
    verify = _cli("verify", str(sfs.b), "--json")
    assert verify.returncode == 0, verify.stderr
    doc = json.loads(verify.stdout)
    assert doc["ok"] and doc["checked"] == len(ks) and doc["bad"] == [], doc
    inspect = _cli("inspect", str(sfs.b), "--json")
    assert inspect.returncode == 0, inspect.stderr
    (ns,) = json.loads(inspect.stdout)["namespaces"]
    assert ns["files"] == len(ks) and ns["bytes"] == len(ks) * 8192, ns
    gc = _cli("gc", str(sfs.b), "--max-bytes", str(4 * 8192), "--json")
    assert gc.returncode == 0, gc.stderr
    assert json.loads(gc.stdout)["evicted_files"] == len(ks) - 4
    # Host a sees host b's eviction: the four newest survive and load byte-exact.
    left = sorted(Path(sfs.a).rglob("*.bin"))
    assert len(left) == 4, left
    with open_tier(sfs.a) as a:
        survivors = [k for k in ks if a.present([k])[0]]
        assert len(survivors) == 4
        res = load(a, "l", survivors)
        assert res.success, res


def _damage(tier, ks) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """Damage four stored files through host a's mount, each a different way;
    returns {how: key}."""
    corrupt, short, foreign, hole = ks[:4]
    p = {k: Path(tier.blocks.path(k)) for k in ks}
    with open(p[corrupt], "r+b") as f:  # one payload byte flipped
        f.seek(4096)
        b = f.read(1)
        f.seek(4096)
        f.write(bytes([b[0] ^ 0xFF]))
    with open(p[short], "r+b") as f:  # cut inside the payload
        f.truncate(4096 + 64)
    # Another key's valid file under this key's name.
    p[foreign].write_bytes(p[ks[5]].read_bytes())
    # A hole where the payload was: what a write lost to a full pool left
    # (the header written, the rest never reached the disk).
    head = p[hole].read_bytes()[:4096]
    size = p[hole].stat().st_size
    with open(p[hole], "r+b") as f:
        f.truncate(4096)
        f.truncate(size)
    assert p[hole].read_bytes()[:4096] == head
    return {"corrupt": corrupt, "short": short, "foreign": foreign, "hole": hole}


def test_damaged_files_from_a_are_misses_on_b(sfs: SharedFs) -> None:
    """Corrupt, short, foreign and holed files written through host a: each
    is a miss on host b (never wrong bytes: load() checks every loaded
    slot), and the intact ones beside them load byte-exact."""
    ks = keys(400, 8)
    with open_tier(sfs.a) as a:
        assert store(a, "s", ks).success
        bad = _damage(a, ks)
    with open_tier(sfs.b) as b:
        causes = {}
        for how, k in bad.items():
            res = load(b, f"l-{how}", [k])
            assert not res.success and res.keys_completed == 0, (how, res)
            causes[how] = res.cause
        good = [k for k in ks if k not in bad.values()]
        res = load(b, "l-good", good)
        assert res.success and res.keys_completed == len(good), res
        # A bad file is not a hit again (removed, or remembered as bad).
        assert b.present(list(bad.values())) == [False] * len(bad)
    assert all(c is not None and c.startswith(("corrupt", "bad_file", "miss")) for c in causes.values()), causes
