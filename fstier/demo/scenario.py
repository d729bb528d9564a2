"""The ``fstier demo`` scenario: the end-to-end tour with real processes and real files.

The parent process plays the engine's scheduler: it creates one
:class:`~fstier.slots.host_pool.HostBlockPool` (named shared memory) and owns the
:class:`~fstier.manager.FsTier` instances. Four spawned processes play GPU
ranks (:mod:`fstier.demo.ranks`, started and called through
:mod:`fstier.demo.processes`): they attach to the pool by name, hold
a synthetic KV cache each, and move bytes with a
:class:`~fstier.gpu_copy.RankStager`. A store is "every rank of the storing
deployment stages out into the same slots, then the parent stores the slots";
a load is "the parent looks up and loads into slots, then every rank of the
loading deployment stages in". Every rank then checks its own KV cache
against content it computes independently, so a byte in the wrong place on
any rank fails the case.

Cases (each compares an observed outcome with the expected one):

1. ``share across tp``: a full-attention model stored by tp=2, loaded by
   tp=4. Expected: hit.
2. ``MLA tp=2 -> tp=4``: rank-private pages. Expected: miss (another
   namespace); the tp=4 ranks recompute.
3. ``hybrid same tp`` / ``hybrid other tp``: full + sliding-window groups.
   Expected: hit at tp=2, miss at tp=4.
4. ``corruption``: one stored file damaged. Expected: the good prefix loads,
   the damaged block is a miss, nothing wrong lands in any rank.
5. ``restart``: a fresh FsTier on the same root. Expected: hit.
"""

from __future__ import annotations

import contextlib
import logging
import random
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fstier.config import FstierConfig, ModelSpec, ParallelSpec, TierConfig
from fstier.demo.processes import (
    DemoError,
    RankProcesses,
    ctrl_c_recorded,
    sigint_deferred,
    start_forkserver,
)
from fstier.demo.ranks import Check, Fill, Setup, Stage
from fstier.errors import ConfigError
from fstier.file_mapper import FileMapper, is_parallel_agnostic
from fstier.io import HEADER_SIZE, padded_len
from fstier.keys import BlockKey, chain_hashes

__all__ = ["CaseResult", "DemoOptions", "DemoReport", "DemoScenario", "run_demo"]

NUM_RANKS = 4
#: Blocks per prompt: 32 x 128 KiB pages = 4 MiB per case for the built-in
#: model, enough to time and small enough that the demo stays well under 30 s
#: on two cores. A bigger model from --config gets fewer (at least 4) blocks.
PROMPT_BLOCKS = 32
PROMPT_BYTES = 4 << 20
MIN_PROMPT_BLOCKS = 4


# -- options and results ------------------------------------------------------------
@dataclass(frozen=True)
class DemoOptions:
    """``root``: where files go (default a temp dir, removed afterwards);
    ``config``: tier settings (and a full-attention model) to use;
    ``per_layer``: one KV tensor per layer instead of the cross-layer layout."""

    root: Path | None = None
    config: FstierConfig | None = None
    per_layer: bool = False
    progress: bool = False


@dataclass
class CaseResult:
    name: str
    expected: str
    outcome: str = "not run"
    stored_blocks: int = 0
    loaded_blocks: int = 0
    verified: bool = False
    bytes: int = 0
    gbps: float = 0.0
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.outcome == self.expected and self.verified

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "expected": self.expected,
            "outcome": self.outcome,
            "ok": self.ok,
            "stored_blocks": self.stored_blocks,
            "loaded_blocks": self.loaded_blocks,
            "verified": self.verified,
            "bytes": self.bytes,
            "gbps": round(self.gbps, 3),
            "detail": self.detail,
        }


@dataclass
class DemoReport:
    root: str
    layout: str
    #: the root was a temp dir made for this run and is deleted by the time
    #: the report is printed (so the path is not worth looking at)
    root_temporary: bool = False
    o_direct: bool = False
    cases: list[CaseResult] = field(default_factory=list)
    store_bytes: int = 0
    store_seconds: float = 0.0
    load_bytes: int = 0
    load_seconds: float = 0.0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return bool(self.cases) and all(c.ok for c in self.cases)

    @property
    def store_gbps(self) -> float:
        return self.store_bytes / self.store_seconds / 1e9 if self.store_seconds else 0.0

    @property
    def load_gbps(self) -> float:
        return self.load_bytes / self.load_seconds / 1e9 if self.load_seconds else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "cases": [c.to_json() for c in self.cases],
            "store_gbps": round(self.store_gbps, 3),
            "load_gbps": round(self.load_gbps, 3),
            "root": self.root,
            "root_temporary": self.root_temporary,
            "cache_layout": self.layout,
            "o_direct": self.o_direct,
            "seconds": round(self.seconds, 2),
        }


# -- models -------------------------------------------------------------------------
def _attn(kind: str = "full_attention", **kw: Any) -> dict[str, Any]:
    return {"kind": kind, "block_size": 16, "num_layers": 4, "num_kv_heads": 8, "head_size": 64, **kw}


FULL_MODEL = ModelSpec.model_validate(
    {"name": "fstier-demo/llama-like", "revision": "demo-1", "dtype": "bfloat16", "groups": [_attn()]}
)
MLA_MODEL = ModelSpec.model_validate(
    {
        "name": "fstier-demo/deepseek-like-mla",
        "revision": "demo-1",
        "dtype": "bfloat16",
        "groups": [{"kind": "mla", "block_size": 16, "num_layers": 4, "num_kv_heads": 1, "head_size": 576}],
    }
)
HYBRID_MODEL = ModelSpec.model_validate(
    {
        "name": "fstier-demo/gemma-like-hybrid",
        "revision": "demo-1",
        "dtype": "bfloat16",
        "groups": [_attn(), _attn("sliding_window", sliding_window=128)],
    }
)


def _par(tp: int, rank: int = 0) -> ParallelSpec:
    return ParallelSpec.model_validate({"tp_size": tp, "rank": rank})


def _check_demo_model(model: ModelSpec) -> None:
    """The share-across-tp case needs a parallel-agnostic, head-sharded model."""
    if not is_parallel_agnostic(model, _par(2)):
        raise ConfigError(
            "model.groups: fstier demo --config needs a parallel-agnostic model (exactly one "
            f"full_attention group) for its share-across-tp case, got kinds "
            f"{[g.kind for g in model.groups]}"
        )
    heads = model.groups[0].num_kv_heads
    for tp in (2, NUM_RANKS):
        if heads % tp and tp % heads:
            raise ConfigError(
                f"model.groups.0.num_kv_heads: the demo shards heads over tp=2 and tp={NUM_RANKS}; "
                f"{heads} heads split evenly over neither, use a multiple or divisor of {NUM_RANKS}"
            )


@dataclass
class _Deployment:
    """A model served at one tp size: ranks 0..tp-1 are processes 0..tp-1,
    and the scheduler's FsTier is built for rank 0."""

    dep_id: str
    model: ModelSpec
    tp: int
    block_ids: list[list[int]]  # per group: GPU block ids of the prompt
    config: FstierConfig


# -- the demo --------------------------------------------------------------------------
class DemoScenario:
    """The parent side of one demo run under ``root``: ``run(status)`` runs
    every case into :attr:`report`, ``close()`` stops the rank processes and
    releases the pool (:func:`run_demo` drives it)."""

    def __init__(self, opts: DemoOptions, root: Path, cleanup: list[Any]) -> None:
        # close() is registered before anything exists to close, so a Ctrl-C
        # at any instant of construction leaves nothing behind (close()
        # handles a half-built scenario).
        self.tiers: list[Any] = []
        cleanup.append(self.close)
        # First, while this process has one thread (start_forkserver's rule):
        # torch, which the demo loads for its ranks, starts threads.
        start_forkserver()
        from fstier.slots.host_pool import HostBlockPool

        self.opts = opts
        self.root = root
        base = (
            opts.config.tier
            if opts.config is not None
            else TierConfig.model_validate({"root_dir": root, "read_threads": 8, "write_threads": 4})
        )
        self.tier = base.model_copy(update={"root_dir": root})
        self.bpf = self.tier.blocks_per_file
        self.full_model = opts.config.model if opts.config is not None else FULL_MODEL
        page = max(g.page_bytes for g in self.full_model.groups)
        blocks = max(MIN_PROMPT_BLOCKS, min(PROMPT_BLOCKS, PROMPT_BYTES // page))
        self.num_blocks = -(-blocks // self.bpf) * self.bpf  # whole files only
        self.num_files = self.num_blocks // self.bpf
        self.gpu_blocks = 2 * self.num_blocks
        self.report = DemoReport(root=str(root), layout="per-layer" if opts.per_layer else "cross-layer")
        slot_bytes = max(
            padded_len(FileMapper(self._config(m, tp)).expected_payload_bytes(g))
            for m in (self.full_model, MLA_MODEL, HYBRID_MODEL)
            for tp in (2, NUM_RANKS)
            for g in range(len(m.groups))
        )
        self.pool = HostBlockPool(2 * self.num_files, slot_bytes)
        self.ranks = RankProcesses(NUM_RANKS)
        self._deps = 0
        self._rng = random.Random(1234)

    def close(self) -> None:
        """Close the tiers, stop the ranks, release the pool: whatever of
        them exists. Held (a Ctrl-C meanwhile is counted, not raised: one
        arriving half-way would leave ranks, temp files or the /dev/shm
        segment behind); idempotent."""
        with sigint_deferred():
            for t in self.tiers:
                with contextlib.suppress(Exception):
                    t.close()
            self.tiers.clear()
            ranks, pool = getattr(self, "ranks", None), getattr(self, "pool", None)
            if ranks is not None:
                ranks.close()
            if pool is not None:
                pool.close()

    # -- plumbing -----------------------------------------------------------------------
    def _config(self, model: ModelSpec, tp: int) -> FstierConfig:
        return FstierConfig(tier=self.tier, model=model, parallel=_par(tp))

    def _tier(self, cfg: FstierConfig) -> Any:
        from fstier.manager import FsTier

        with sigint_deferred():
            tier = FsTier(cfg, self.pool)
            self.tiers.append(tier)
        self.report.o_direct = self.report.o_direct or tier.io_options.o_direct
        return tier

    def deploy(self, model: ModelSpec, tp: int) -> _Deployment:
        """Bring up ``tp`` rank processes for ``model`` with a zeroed KV cache."""
        self._deps += 1
        dep_id = f"d{self._deps}"
        ids = self._rng.sample(range(self.gpu_blocks), len(model.groups) * self.num_blocks)
        per_group = [ids[g * self.num_blocks : (g + 1) * self.num_blocks] for g in range(len(model.groups))]
        msgs = [
            (
                r,
                Setup(
                    dep_id,
                    model.model_dump(mode="json"),
                    _par(tp, r).model_dump(mode="json"),
                    self.pool.name,
                    self.gpu_blocks,
                    self.opts.per_layer,
                    self.bpf,
                ),
            )
            for r in range(tp)
        ]
        self.ranks.call(msgs)
        return _Deployment(dep_id, model, tp, per_group, self._config(model, tp))

    def _all(self, dep: _Deployment, msg: Any) -> list[Any]:
        return self.ranks.call([(r, msg) for r in range(dep.tp)])

    def keys(self, model: ModelSpec, prompt: int) -> list[list[BlockKey]]:
        """Per group, one key per file: the chained hash of the file's last block."""
        bs = model.groups[0].block_size
        tokens = [(prompt * 7919 + i * 31) % 50000 for i in range(self.num_blocks * bs)]
        hashes = chain_hashes(tokens, bs)
        per_file = [hashes[(f + 1) * self.bpf - 1] for f in range(self.num_files)]
        return [[BlockKey(h, g) for h in per_file] for g in range(len(model.groups))]

    def prefill(self, dep: _Deployment, files: int | None = None, start_file: int = 0) -> None:
        """Compute blocks on every rank (what the engine does on a miss)."""
        stop = self.num_files if files is None else start_file + files
        lo, hi = start_file * self.bpf, stop * self.bpf
        self._all(
            dep,
            Fill(dep.dep_id, [ids[lo:hi] for ids in dep.block_ids], [list(range(lo, hi)) for _ in dep.block_ids]),
        )

    def check(self, dep: _Deployment, files: int | None = None) -> list[list[list[str]]]:
        """Per rank, per group, one verdict per block of the first ``files`` files."""
        hi = (self.num_files if files is None else files) * self.bpf
        return self._all(
            dep, Check(dep.dep_id, [ids[:hi] for ids in dep.block_ids], [list(range(hi)) for _ in dep.block_ids])
        )

    def store(self, dep: _Deployment, tier: Any, keys: list[list[BlockKey]]) -> tuple[int, int]:
        """Ranks stage out every file, the parent stores them. Returns (blocks, bytes)."""
        groups = len(dep.model.groups)
        slots = self.pool.alloc(groups * self.num_files)
        try:
            flat_ids = [b for ids in dep.block_ids for b in ids]
            self._all(dep, Stage(dep.dep_id, "out", flat_ids, [self.num_blocks] * groups, [0] * groups, slots))
            all_keys = [k for ks in keys for k in ks]
            tier.submit_store(f"store-{dep.dep_id}-{time.monotonic_ns()}", all_keys, slots)
            tier.drain()
            results = tier.get_finished()
        finally:
            self.pool.free(slots)
        res = results[-1]
        if not res.success:
            raise DemoError(f"store of {len(all_keys)} file(s) failed: {res.cause}")
        self.report.store_bytes += res.nbytes
        self.report.store_seconds += res.seconds
        return res.keys_completed * self.bpf, res.nbytes

    def load(self, dep: _Deployment, tier: Any, keys: list[list[BlockKey]]) -> _LoadOutcome:
        """Lookup, load the hit prefix, stage it in on every rank. One job per
        group; the usable prefix is the shortest group's."""
        hits = min(tier.lookup(ks) for ks in keys)
        if hits == 0:
            return _LoadOutcome(0, 0, 0, 0.0, None)
        groups = len(keys)
        slots = self.pool.alloc(groups * hits)
        try:
            for g, ks in enumerate(keys):
                tier.submit_load(
                    f"load-{dep.dep_id}-{g}-{time.monotonic_ns()}", ks[:hits], slots[g * hits : (g + 1) * hits]
                )
            tier.drain()
            results = tier.get_finished()
            prefix = min(r.keys_completed for r in results)
            cause = next((r.cause for r in results if r.cause), None)
            nbytes = sum(r.nbytes for r in results)
            seconds = max(r.seconds for r in results)
            if prefix:
                # Slots of group g start at g*hits; stage in the common prefix only.
                use = [s for g in range(groups) for s in slots[g * hits : g * hits + prefix]]
                nblk = prefix * self.bpf
                flat_ids = [b for ids in dep.block_ids for b in ids[:nblk]]
                self._all(dep, Stage(dep.dep_id, "in", flat_ids, [nblk] * groups, [0] * groups, use))
        finally:
            self.pool.free(slots)
        self.report.load_bytes += nbytes
        self.report.load_seconds += seconds
        return _LoadOutcome(hits, prefix, nbytes, seconds, cause)

    # -- cases ---------------------------------------------------------------------------
    def store_prompt(
        self, model: ModelSpec, tp: int, prompt: int
    ) -> tuple[_Deployment, Any, list[list[BlockKey]], int]:
        dep = self.deploy(model, tp)
        tier = self._tier(dep.config)
        keys = self.keys(model, prompt)
        self.prefill(dep)
        stored, _ = self.store(dep, tier, keys)
        return dep, tier, keys, stored

    def load_and_verify(
        self, case: CaseResult, model: ModelSpec, tp: int, keys: list[list[BlockKey]], tier: Any = None
    ) -> tuple[_LoadOutcome, list[list[list[str]]]]:
        """A fresh deployment at ``tp`` loads what it can, checks that every
        loaded block is exact and every other block untouched, then
        recomputes the rest and checks everything."""
        dep = self.deploy(model, tp)
        tier = tier if tier is not None else self._tier(dep.config)
        out = self.load(dep, tier, keys)
        after_load = self.check(dep)
        loaded_ok = all(
            v == ("match" if i < out.prefix * self.bpf else "zero")
            for rank in after_load
            for group in rank
            for i, v in enumerate(group)
        )
        if out.prefix < self.num_files:
            self.prefill(dep, self.num_files - out.prefix, out.prefix)
        final = self.check(dep)
        all_ok = all(v == "match" for rank in final for group in rank for v in group)
        # Blocks count pages of every group (a hybrid block is two pages).
        case.loaded_blocks = out.prefix * self.bpf * len(model.groups)
        case.verified = loaded_ok and all_ok
        case.bytes = case.bytes + out.nbytes
        if out.seconds:
            case.gbps = out.nbytes / out.seconds / 1e9
        if out.prefix == self.num_files:
            case.outcome = "hit"
        elif out.prefix == 0 and out.hits == 0:
            case.outcome = "miss"
        else:
            case.outcome = f"partial {out.prefix}/{self.num_files}"
        if not loaded_ok:
            case.detail += " WRONG BYTES LOADED;"
        return out, after_load

    def case_share_across_tp(self) -> tuple[CaseResult, list[list[BlockKey]]]:
        case = CaseResult("share across tp (tp=2 -> tp=4)", "hit")
        dep, tier, keys, stored = self.store_prompt(self.full_model, 2, prompt=1)
        case.stored_blocks = stored
        self.load_and_verify(case, self.full_model, NUM_RANKS, keys)
        same = (
            FileMapper(self._config(self.full_model, 2)).namespace
            == FileMapper(self._config(self.full_model, NUM_RANKS)).namespace
        )
        case.detail = f"one namespace for tp=2 and tp=4: {same}; {NUM_RANKS} ranks verified"
        case.verified = case.verified and same
        return case, keys

    def case_mla(self) -> CaseResult:
        case = CaseResult("MLA (tp=2 -> tp=4)", "miss")
        _, _, keys, stored = self.store_prompt(MLA_MODEL, 2, prompt=2)
        case.stored_blocks = stored
        self.load_and_verify(case, MLA_MODEL, NUM_RANKS, keys)
        a = FileMapper(self._config(MLA_MODEL, 2)).namespace
        b = FileMapper(self._config(MLA_MODEL, NUM_RANKS)).namespace
        case.detail = f"rank-private: {a[-16:]} vs {b[-16:]}; recomputed"
        case.verified = case.verified and a != b
        return case

    def case_hybrid(self) -> list[CaseResult]:
        same = CaseResult("hybrid full+sliding (tp=2 -> tp=2)", "hit")
        other = CaseResult("hybrid full+sliding (tp=2 -> tp=4)", "miss")
        _, tier, keys, stored = self.store_prompt(HYBRID_MODEL, 2, prompt=3)
        same.stored_blocks = stored
        self.load_and_verify(same, HYBRID_MODEL, 2, keys, tier=tier)
        same.detail = "2 groups per block, same namespace"
        self.load_and_verify(other, HYBRID_MODEL, NUM_RANKS, keys)
        other.detail = "tp is part of a hybrid namespace; recomputed"
        return [same, other]

    def case_corruption(self) -> tuple[CaseResult, list[list[BlockKey]], int]:
        bad = self.num_files // 2
        case = CaseResult("corruption (one file damaged)", f"partial {bad}/{self.num_files}")
        _, tier, keys, stored = self.store_prompt(self.full_model, 2, prompt=4)
        case.stored_blocks = stored
        path = tier.mapper.path_for(keys[0][bad])
        with open(path, "r+b") as f:  # flip one payload bit in the middle of the file
            off = HEADER_SIZE + tier.payload_bytes(keys[0][bad]) // 2
            f.seek(off)
            byte = f.read(1)
            f.seek(off)
            f.write(bytes([byte[0] ^ 0x10]))
        # The tier logs the corrupt file as a warning; here it is the point of
        # the case and is reported in the table instead.
        quiet = logging.getLogger("fstier.manager")
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            out, _ = self.load_and_verify(case, self.full_model, NUM_RANKS, keys)
        finally:
            quiet.setLevel(level)
        removed = not path.exists()
        case.detail = f"block {bad}: {out.cause or 'no error'}; damaged file removed: {removed}"
        case.verified = case.verified and removed and bool(out.cause and out.cause.startswith("corrupt"))
        return case, keys, bad

    def case_restart(self, keys: list[list[BlockKey]], damaged: list[list[BlockKey]], bad: int) -> CaseResult:
        case = CaseResult("restart (new FsTier, same root)", "hit")
        for t in self.tiers:
            t.close()
        self.tiers.clear()
        from fstier.manager import FsTier

        with sigint_deferred():
            tier = FsTier.from_config(self._config(self.full_model, NUM_RANKS), self.pool)
            self.tiers.append(tier)
        again = tier.lookup(damaged[0])
        self.load_and_verify(case, self.full_model, NUM_RANKS, keys, tier=tier)
        case.detail = (
            f"lookup after restart: {tier.lookup(keys[0])}/{self.num_files}; damaged prompt: {again}/{self.num_files}"
        )
        case.verified = case.verified and again == bad
        return case

    def run(self, status: Any = None) -> None:
        def step(text: str) -> None:
            if status is not None:
                status.update(f"fstier demo: {text}")

        step("share across tp (tp=2 stores, tp=4 loads)")
        share, keys = self.case_share_across_tp()
        self.report.cases.append(share)
        step("MLA (tp=2 -> tp=4)")
        self.report.cases.append(self.case_mla())
        step("hybrid full + sliding window")
        self.report.cases.extend(self.case_hybrid())
        step("corruption")
        corrupt, damaged, bad = self.case_corruption()
        self.report.cases.append(corrupt)
        step("restart")
        self.report.cases.append(self.case_restart(keys, damaged, bad))


@dataclass(frozen=True, slots=True)
class _LoadOutcome:
    hits: int
    prefix: int
    nbytes: int
    seconds: float
    cause: str | None


def _root_dir(opts: DemoOptions, cleanup: list[Any]) -> Path:
    """The demo's root; a temporary one is registered for removal the
    moment it exists (held: no Ctrl-C between its mkdtemp and that)."""
    if opts.root is not None:
        opts.root.mkdir(parents=True, exist_ok=True)
        return opts.root
    if opts.config is not None:
        cfg_root = Path(opts.config.tier.root_dir)
        cfg_root.mkdir(parents=True, exist_ok=True)
        return cfg_root
    with sigint_deferred():
        tmp = Path(tempfile.mkdtemp(prefix="fstier-demo-"))
        cleanup.append(lambda: shutil.rmtree(tmp, ignore_errors=True))
    return tmp


def run_demo(opts: DemoOptions) -> DemoReport:
    """Run every case; the report says whether each outcome matched. A
    Ctrl-C at any instant raises KeyboardInterrupt once everything it made
    is gone (fstier.demo.processes' Ctrl-C rules)."""
    if opts.config is not None:
        _check_demo_model(opts.config.model)
    t0 = time.perf_counter()
    with ctrl_c_recorded():
        start_forkserver()  # before any thread (the progress display runs one)
        # What to undo, last first. The cleanup below is inline in the
        # finally, inside a try: a Ctrl-C at its first instruction is caught
        # there and the cleanup runs again (each step is idempotent, held).
        cleanup: list[Any] = []
        try:
            root = _root_dir(opts, cleanup)
            status: Any = None
            if opts.progress:
                from rich.console import Console

                with sigint_deferred():
                    status = Console(stderr=True).status("fstier demo: starting 4 rank processes...")
                    status.start()
                    cleanup.append(status.stop)
            demo = DemoScenario(opts, root, cleanup)
            demo.run(status)
        finally:
            while cleanup:
                try:
                    with sigint_deferred():
                        while cleanup:
                            cleanup[-1]()
                            cleanup.pop()
                except KeyboardInterrupt:
                    pass  # counted: ctrl_c_recorded raises it again
        demo.report.seconds = time.perf_counter() - t0
        demo.report.root_temporary = opts.root is None and opts.config is None
        return demo.report
