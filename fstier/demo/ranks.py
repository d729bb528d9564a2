"""The demo's synthetic engine: deterministic KV content and rank processes.

Content. Every element of a synthetic KV cache is a pure function of
``(model, group, layer, k|v, token position, global head, dim)``: the
coordinates are folded into an int64 with a multiply-add chain, mixed
(xorshift-multiply, wrapping arithmetic is deterministic), reduced mod 251
and scaled to multiples of 1/8 in [-15.6, 15.6], which bf16 and fp16 hold
exactly. So any rank of any deployment can compute the exact bytes its
local shard of any block must hold, without talking to anyone: that is how
the demo proves a tp=4 rank loaded what two tp=2 ranks stored.

Rank processes. :func:`rank_main` is the entry point of one spawned process.
It attaches to the parent's :class:`~fstier.slots.host_pool.HostBlockPool` by name
and, per *deployment* (a model at a tp size, this process playing one rank),
allocates a KV cache (the cross-layer layout by default, one tensor per layer
with ``per_layer``), registers it, builds its :class:`~fstier.gpu_copy.RankStager`
from :func:`~fstier.layout.rank_page_mapping`, and then serves commands from
the parent over a pipe: fill blocks with the expected content (a "prefill"),
stage blocks out to slots or in from slots, check blocks, clear the cache.
Messages are small frozen dataclasses; every reply is a :class:`Reply`.
"""

from __future__ import annotations

import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash

from fstier.config import KVGroupSpec, ModelSpec, ParallelSpec

__all__ = [
    "Check",
    "Clear",
    "Fill",
    "Quit",
    "Reply",
    "Setup",
    "Stage",
    "model_seed",
    "rank_main",
]

_MUL = 1_000_003
_MIX = 0x5851F42D4C957F2D


def model_seed(model: ModelSpec) -> int:
    """A stable 31-bit seed per model identity (name, revision)."""
    ident = f"{model.name}\0{model.revision or ''}".encode()
    return xxhash.xxh64_intdigest(ident) & 0x7FFFFFFF


# -- messages (parent -> rank) ---------------------------------------------------
@dataclass(frozen=True, slots=True)
class Setup:
    """Become rank ``parallel.rank`` of deployment ``dep`` of ``model``."""

    dep: str
    model: dict[str, Any]
    parallel: dict[str, Any]
    pool_name: str
    num_blocks: int
    per_layer: bool
    blocks_per_file: int


@dataclass(frozen=True, slots=True)
class Fill:
    """Write the expected content of logical blocks ``logical[g]`` into GPU
    blocks ``block_ids[g]`` of each group (what a prefill computes)."""

    dep: str
    block_ids: list[list[int]]
    logical: list[list[int]]


@dataclass(frozen=True, slots=True)
class Stage:
    """``stage_out`` (direction ``out``) or ``stage_in`` (``in``) of a spec."""

    dep: str
    direction: str
    block_ids: list[int]
    group_sizes: list[int]
    block_indices: list[int]
    slots: list[int]


@dataclass(frozen=True, slots=True)
class Check:
    """Compare GPU blocks with the expected content of their logical blocks."""

    dep: str
    block_ids: list[list[int]]
    logical: list[list[int]]


@dataclass(frozen=True, slots=True)
class Clear:
    """Zero the deployment's KV cache (a fresh engine)."""

    dep: str


@dataclass(frozen=True, slots=True)
class Quit:
    pass


@dataclass(frozen=True, slots=True)
class Reply:
    """``ok`` and a value, or the error text (a traceback) when not ok.
    For :class:`Check` the value is, per group, one verdict per block:
    ``match``, ``zero`` (untouched) or ``wrong``."""

    ok: bool
    value: Any = None
    error: str = ""


# -- geometry and content ------------------------------------------------------------
def local_heads(group: KVGroupSpec, par: ParallelSpec) -> tuple[int, int]:
    """(first global head, number of heads) this rank holds; mirrors
    fstier.layout: an even share, or one replicated head."""
    hr = par.tp_size // par.dcp_size
    head_rank = par.tp_rank // par.dcp_size
    big_h = group.num_kv_heads
    if big_h % hr == 0:
        hl = big_h // hr
        return head_rank * hl, hl
    per = max(1, hr // big_h)
    return head_rank // per, 1


def layer_state_shape(group: KVGroupSpec, par: ParallelSpec) -> tuple[int, ...]:
    """One layer's per-block local shape (the demo runs pp = pcp = dcp = 1)."""
    if group.kind == "mla":
        return (group.block_size, group.head_size)
    _, hl = local_heads(group, par)
    if group.kv_layout == "NHD":
        return (2, group.block_size, hl, group.head_size)
    return (2, hl, group.block_size, group.head_size)


def expected_blocks(seed: int, g: int, group: KVGroupSpec, layer: int, par: ParallelSpec, logical: Any) -> Any:
    """Expected content of ``logical`` blocks of one layer, shape
    ``(len(logical), *layer_state_shape)`` in the group's dtype."""
    import torch

    blocks = torch.as_tensor(logical, dtype=torch.int64)
    bs, hd = group.block_size, group.head_size
    tok = torch.arange(bs, dtype=torch.int64)
    dim = torch.arange(hd, dtype=torch.int64)
    if group.kind == "mla":
        pos = blocks.view(-1, 1, 1) * bs + tok.view(1, -1, 1)
        kv = torch.zeros(1, 1, 1, dtype=torch.int64)
        head = torch.zeros(1, 1, 1, dtype=torch.int64)
        d = dim.view(1, 1, -1)
    else:
        h0, hl = local_heads(group, par)
        heads = torch.arange(h0, h0 + hl, dtype=torch.int64)
        kv = torch.arange(2, dtype=torch.int64).view(1, 2, 1, 1, 1)
        d = dim.view(1, 1, 1, 1, -1)
        if group.kv_layout == "NHD":
            pos = blocks.view(-1, 1, 1, 1, 1) * bs + tok.view(1, 1, -1, 1, 1)
            head = heads.view(1, 1, 1, -1, 1)
        else:
            pos = blocks.view(-1, 1, 1, 1, 1) * bs + tok.view(1, 1, 1, -1, 1)
            head = heads.view(1, 1, -1, 1, 1)
    x = torch.tensor(seed, dtype=torch.int64)
    for coord in (torch.tensor(g), torch.tensor(layer), kv, pos, head, d):
        x = x * _MUL + coord
    x = x ^ (x >> 31)
    x = x * _MIX
    x = x ^ (x >> 29)
    values = (torch.remainder(x, 251) - 125).to(torch.float32) / 8.0
    return values.to(getattr(torch, group.dtype or "bfloat16"))


# -- one rank of one deployment ------------------------------------------------------
@dataclass
class _Deployment:
    model: ModelSpec
    parallel: ParallelSpec
    seed: int
    layers: list[list[Any]]  # per group, per layer: (num_blocks, *state) tensor
    stager: Any
    keep: list[Any] = field(default_factory=list)
    #: (group, layer, logical blocks) -> expected tensor; fill and both checks
    #: of a case ask for the same blocks, and computing them dominates a check.
    expected: dict[tuple[int, int, tuple[int, ...]], Any] = field(default_factory=dict)

    def want(self, g: int, layer: int, logical: Sequence[int]) -> Any:
        key = (g, layer, tuple(logical))
        t = self.expected.get(key)
        if t is None:
            group = self.model.groups[g]
            t = self.expected[key] = expected_blocks(self.seed, g, group, layer, self.parallel, logical)
        return t


def _setup(msg: Setup, pools: dict[str, Any]) -> _Deployment:
    import torch

    from fstier.cross_layer import LayerKVSpec, StateSpec, allocate_cross_layer_kv_caches
    from fstier.gpu_copy import RankStager
    from fstier.layout import (
        CanonicalKVCaches,
        rank_page_mapping,
    )
    from fstier.slots.host_pool import HostBlockPool

    model = ModelSpec.model_validate(msg.model)
    par = ParallelSpec.model_validate(msg.parallel)
    pool = pools.get(msg.pool_name)
    if pool is None:
        pool = pools[msg.pool_name] = HostBlockPool.attach(msg.pool_name)
    layers: list[list[Any]] = []
    keep: list[Any] = []
    if msg.per_layer:
        for group in model.groups:
            shape = layer_state_shape(group, par)
            dtype = getattr(torch, group.dtype or model.dtype)
            layers.append([torch.zeros((msg.num_blocks, *shape), dtype=dtype) for _ in range(group.num_layers)])
        caches = CanonicalKVCaches.register(layers)
    else:
        specs = [
            LayerKVSpec(f"g{g}.layer{j}", g, (StateSpec(layer_state_shape(group, par), group.dtype),))
            for g, group in enumerate(model.groups)
            for j in range(group.num_layers)
        ]
        cross = allocate_cross_layer_kv_caches(specs, msg.num_blocks, device="cpu", dtype=model.dtype)
        keep.append(cross)
        for g, group in enumerate(model.groups):
            layers.append([cross.views[f"g{g}.layer{j}"][0] for j in range(group.num_layers)])
        caches = cross.registration
    mappings = [rank_page_mapping(group, par, "packed") for group in model.groups]
    stager = RankStager(caches, mappings, pool, blocks_per_file=msg.blocks_per_file)
    return _Deployment(model, par, model_seed(model), layers, stager, keep)


def _fill(dep: _Deployment, msg: Fill) -> None:
    import torch

    for g in range(len(dep.model.groups)):
        ids = torch.as_tensor(msg.block_ids[g], dtype=torch.long)
        if ids.numel() == 0:
            continue
        for j, t in enumerate(dep.layers[g]):
            t[ids] = dep.want(g, j, msg.logical[g])


def _check(dep: _Deployment, msg: Check) -> list[list[str]]:
    import torch

    out: list[list[str]] = []
    for g in range(len(dep.model.groups)):
        verdicts = ["match"] * len(msg.block_ids[g])
        zero = [True] * len(msg.block_ids[g])
        if msg.block_ids[g]:
            ids = torch.as_tensor(msg.block_ids[g], dtype=torch.long)
            for j, t in enumerate(dep.layers[g]):
                want = dep.want(g, j, msg.logical[g])
                have = t[ids]
                # Compare bytes: exact, and NaN-safe for any dtype.
                same = (have.view(torch.int8) == want.view(torch.int8)).flatten(1).all(dim=1)
                empty = (have.view(torch.int8) == 0).flatten(1).all(dim=1)
                for i in range(len(verdicts)):
                    if not bool(same[i]):
                        verdicts[i] = "wrong"
                    zero[i] = zero[i] and bool(empty[i])
            verdicts = ["zero" if v == "wrong" and z else v for v, z in zip(verdicts, zero, strict=True)]
        out.append(verdicts)
    return out


def _stage(dep: _Deployment, msg: Stage) -> int:
    from fstier.layout import LoadStoreSpec

    spec = LoadStoreSpec(msg.block_ids, msg.group_sizes, msg.block_indices)
    if msg.direction == "out":
        batch = dep.stager.stage_out(spec, msg.slots)
    elif msg.direction == "in":
        batch = dep.stager.stage_in(msg.slots, spec)
    else:
        raise ValueError(f"Stage.direction must be 'out' or 'in', got {msg.direction!r}")
    dep.stager.wait(batch)
    return int(dep.stager.stats.bytes)


def rank_main(conn: Any) -> None:
    """Serve commands on ``conn`` until :class:`Quit` or the pipe closes."""
    import signal

    # Ctrl-C is the parent's to handle (it stops the ranks and cleans up);
    # a rank that raised KeyboardInterrupt would only add a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torch

    # Import the staging modules now, while the parent is still setting up.
    import fstier.gpu_copy
    import fstier.layout  # noqa: F401

    # Two cores: a rank must not spawn a thread per core on top of its peers.
    torch.set_num_threads(1)
    pools: dict[str, Any] = {}
    deployments: dict[str, _Deployment] = {}
    try:
        while True:
            try:
                msg = conn.recv()
            except EOFError:
                return
            if isinstance(msg, Quit):
                conn.send(Reply(True))
                return
            try:
                value: Any = None
                if isinstance(msg, Setup):
                    deployments[msg.dep] = _setup(msg, pools)
                elif isinstance(msg, Fill):
                    _fill(deployments[msg.dep], msg)
                elif isinstance(msg, Stage):
                    value = _stage(deployments[msg.dep], msg)
                elif isinstance(msg, Check):
                    value = _check(deployments[msg.dep], msg)
                elif isinstance(msg, Clear):
                    for group_layers in deployments[msg.dep].layers:
                        for t in group_layers:
                            t.zero_()
                else:
                    raise TypeError(f"unknown demo command {type(msg).__name__}")
                conn.send(Reply(True, value))
            except Exception:
                conn.send(Reply(False, error=traceback.format_exc(limit=8)))
    finally:
        deployments.clear()
        for pool in pools.values():
            pool.close()
