"""One "host" of the two-host engine-like capacity workload
(``test_capacity_workload.py``): a tier with ``max_bytes`` on its own mount
of the shared root, looping like an engine serving prompts.

    python _workload_host.py ROOT MAX_BYTES SECONDS HOST_ID PEER_ID

Each round: store a new 16-block prompt and wait for it; look up a recent
prompt of this host or (half the time) of the peer, load the hit prefix and
check every loaded byte; sleep 50 ms. Prints ``drained`` when its last job
ended, waits for a line on stdin (the peer drained too), waits until its count is
settled (``SETTLE_S`` at least, ``SETTLE_LIMIT_S`` at most) and prints one
JSON line: its view of the root's usage, its counts and the
tier's capacity metrics.

``FSTIER_WORKLOAD_ROUND_DELAY_S`` (fault injection): each round of the
``fstier-usage`` thread takes this much longer, half before publishing this
instance's count and half before listing the others', as on a slow or
loaded mount (CI's GlusterFS took ~1 s per round while two hosts started).
``FSTIER_WORKLOAD_SECOND_HOST_AFTER_S``: host 2 makes its tier this much
later (hosts of one deployment started a little apart).
"""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from conftest import make_config  # noqa: E402

import fstier  # noqa: E402
from fstier.keys import BlockKey  # noqa: E402
from fstier.manager import FsTier  # noqa: E402
from fstier.slots.host_pool import HostBlockPool  # noqa: E402

#: 4 layers x 8 KV heads x 128 head size, fp16, 16 tokens: 256 KiB pages
GROUP = {"kind": "full_attention", "block_size": 16, "num_layers": 4, "num_kv_heads": 8, "head_size": 128}
PAGE = 16 * 4 * 8 * 128 * 2 * 2
PROMPT_BLOCKS = 16
#: a host's recent prompts the lookups pick from
RECENT = 8
#: after both hosts drained: at least this long (publication, a FUSE
#: mount's 1 s caches), then until the count is settled (``Capacity.settled``:
#: the capacity thread's quiet rescan, or another host's shared) or at most
#: SETTLE_LIMIT_S
SETTLE_S = 2.0
SETTLE_LIMIT_S = 90.0


def prompt_keys(host: int, prompt: int) -> list[BlockKey]:
    base = host * 10_000_000 + prompt * PROMPT_BLOCKS
    return [BlockKey(i.to_bytes(4, "big") * 4, 0) for i in range(base, base + PROMPT_BLOCKS)]


def fill_byte(k: BlockKey) -> int:
    return k.block_hash[3] ^ k.block_hash[2] ^ 0x5A


def _trace(tier: FsTier, path: str) -> None:
    """Diagnostics (``FSTIER_WORKLOAD_TRACE=PREFIX``): this instance's
    shared-count state every 0.25 s, as JSON lines."""
    u = tier.capacity._shared
    t0 = time.monotonic()
    with open(path, "w") as f:
        while True:
            snap = tier.metrics.snapshot()
            f.write(json.dumps({
                "t": round(time.monotonic() - t0, 2), "view": tier.usage_bytes,
                "own": [u._stored, u._removed] if u else None,
                "base": u._base if u else None, "own_base": u._own_base if u else None,
                "others": u._others if u else None, "others_base": u._others_base if u else None,
                "lease": u.holds_lease if u else None,
                "evicted": snap.get("fstier_evicted_bytes_total"),
                "dropped": snap.get("fstier_store_dropped_blocks_total"),
            }) + "\n")
            f.flush()
            time.sleep(0.25)


def _slow_usage_rounds(delay: float) -> None:
    """Make every publish and every listing of the shared count ``delay / 2`` s slower."""
    from fstier.tier import usage

    publish, read_others = usage.SharedUsage._publish, usage.SharedUsage._read_others

    def slow_publish(self: usage.SharedUsage, dfd: int, force: bool = False) -> None:
        time.sleep(delay / 2)
        publish(self, dfd, force)

    def slow_read_others(self: usage.SharedUsage, dfd: int) -> None:
        time.sleep(delay / 2)
        read_others(self, dfd)

    usage.SharedUsage._publish = slow_publish  # type: ignore[method-assign]
    usage.SharedUsage._read_others = slow_read_others  # type: ignore[method-assign]


def main() -> None:
    delay = float(os.environ.get("FSTIER_WORKLOAD_ROUND_DELAY_S", "0"))
    if delay:
        _slow_usage_rounds(delay)
    root, max_bytes, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    me, peer = int(sys.argv[4]), int(sys.argv[5])
    if me == 2:  # the second host starts this much later (its tier is made after the first's)
        time.sleep(float(os.environ.get("FSTIER_WORKLOAD_SECOND_HOST_AFTER_S", "0")))
    # The tests' tree, not an installed fstier (PYTHONPATH must name it).
    here = Path(__file__).resolve().parents[2]
    assert Path(fstier.__file__).resolve().is_relative_to(here), (fstier.__file__, here)
    cfg = make_config(
        Path(root), groups=[dict(GROUP)],
        tier={"max_bytes": max_bytes, "write_threads": 4, "read_threads": 4, "io_timeout_s": 30},
    )
    pool = HostBlockPool(2 * PROMPT_BLOCKS, PAGE)
    store_slots = pool.alloc(PROMPT_BLOCKS)
    load_slots = pool.alloc(PROMPT_BLOCKS)
    tier = FsTier(cfg, pool)
    rng = random.Random(me)
    stats = {
        "stored": 0, "dropped": 0, "store_failed": 0, "loaded": 0, "load_missed": 0,
        "load_failed": 0, "wrong_bytes": 0, "lookups": 0, "lookup_hits": 0,
    }
    causes: dict[str, int] = {}
    job = 0

    def wait(jid: int) -> list:  # type: ignore[type-arg]
        while True:
            done = [r for r in tier.get_finished() if r.job_id == jid]
            if done:
                return done
            time.sleep(0.002)

    trace = os.environ.get("FSTIER_WORKLOAD_TRACE")
    if trace:
        trace_file = f"{trace}-{Path(root).parent.parent.name}-{Path(root).name}-{me}.jsonl"
        threading.Thread(target=_trace, args=(tier, trace_file), daemon=True).start()
    prompt = 0
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            ks = prompt_keys(me, prompt)
            for k, s in zip(ks, store_slots, strict=True):
                pool.slot_view(s)[:PAGE] = bytes([fill_byte(k)]) * PAGE
            job += 1
            tier.submit_store(job, ks, store_slots)
            (r,) = wait(job)
            stats["stored"] += r.keys_completed
            if r.cause == "capacity":
                stats["dropped"] += r.keys_failed
            elif not r.success:
                stats["store_failed"] += r.keys_failed
                causes[f"store:{r.cause}"] = causes.get(f"store:{r.cause}", 0) + r.keys_failed
            prompt += 1
            # A recent prompt of this host or the peer's (about as far along).
            who = peer if rng.random() < 0.5 else me
            want = prompt_keys(who, max(0, prompt - 1 - rng.randrange(RECENT)))
            stats["lookups"] += 1
            n = tier.lookup(want)
            if n:
                stats["lookup_hits"] += 1
                job += 1
                tier.submit_load(job, want[:n], load_slots[:n])
                (r,) = wait(job)
                stats["loaded"] += r.keys_completed
                if r.cause == "miss" or (r.cause or "").startswith("ENOENT"):
                    stats["load_missed"] += r.keys_failed  # evicted meanwhile
                elif not r.success:
                    stats["load_failed"] += r.keys_failed
                    causes[f"load:{r.cause}"] = causes.get(f"load:{r.cause}", 0) + r.keys_failed
                for k, s in zip(want[: r.keys_completed], load_slots, strict=False):
                    if bytes(pool.slot_view(s)[:PAGE]) != bytes([fill_byte(k)]) * PAGE:
                        stats["wrong_bytes"] += 1
            time.sleep(0.05)
        tier.drain(120)
        tier.get_finished()
        print("drained", flush=True)
        sys.stdin.readline()
        t0 = time.monotonic()
        time.sleep(SETTLE_S)
        while not tier.capacity.settled and time.monotonic() - t0 < SETTLE_LIMIT_S:
            time.sleep(0.1)
        stats["settle_s"] = round(time.monotonic() - t0, 1)
        snap = tier.metrics.snapshot()
        print(json.dumps({
            "usage": tier.usage_bytes, **stats, "causes": causes,
            "evicted_bytes": snap.get("fstier_evicted_bytes_total"),
            "dropped_total": snap.get("fstier_store_dropped_blocks_total"),
        }), flush=True)
    finally:
        tier.close()
        pool.close()


if __name__ == "__main__":
    main()
