"""SGLang's HiCache storage seam on a CPU-only machine, for tests and benchmarks.

SGLang's engine does not run on CPU from the registry, but its storage
factory, its host KV pools and its built-in ``HiCacheFile`` backend do. This
module builds them the way SGLang's cache controller does
(``attach_storage_backend``): ``StorageBackendFactory.create_backend(name,
storage_config, host_pool)``, then ``register_mem_pool_host(host_pool)`` and
``on_host_pools_registered()``. Host pools are real
``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost`` objects over CPU "device"
buffers, with ``pin_memory=False``.

Importing SGLang's host-pool modules pulls in its model-config package,
which imports ``torchvision``; the registry's torchvision wheel does not load
against the CPU torch, so :func:`import_sglang` first puts an inert stand-in
package in place (only when torchvision itself is not importable).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any

FSTIER_EXTRA = {
    "backend_name": "fstier",
    "module_path": "fstier.integrations.sglang",
    "class_name": "FstierHiCacheStorage",
    "interface_v1": True,
}


class _Inert:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> _Inert:
        return self


def _inert_attr(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return _Inert


class _TorchvisionStandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers ``import torchvision[.x.y]`` with empty packages whose every
    attribute is an inert class (SGLang's config modules only name them)."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        m = types.ModuleType(spec.name)
        m.__path__ = []
        m.__getattr__ = _inert_attr  # type: ignore[method-assign]
        return m

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def _torchvision_loads() -> bool:
    if importlib.util.find_spec("torchvision") is None:
        return False
    try:
        import torchvision  # noqa: F401
    except Exception:
        return False
    return True


def import_sglang() -> types.SimpleNamespace:
    """SGLang's storage factory, config and host-pool classes (raises
    ImportError when SGLang is not installed)."""
    import transformers.utils.import_utils  # noqa: F401  (decides torchvision's absence first)

    if not _torchvision_loads() and not any(
        isinstance(f, _TorchvisionStandIn) for f in sys.meta_path
    ):
        sys.modules.pop("torchvision", None)
        sys.meta_path.insert(0, _TorchvisionStandIn())
    from sglang.srt.mem_cache.device_pool_info import (
        KVBufferLayout,
        KVBuffers,
        MHABufferInfo,
        MLABufferInfo,
    )
    from sglang.srt.mem_cache.hicache_storage import (
        HiCacheFile,
        HiCacheStorage,
        HiCacheStorageConfig,
        HiCacheStorageExtraInfo,
    )
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    return types.SimpleNamespace(
        HiCacheFile=HiCacheFile,
        HiCacheStorage=HiCacheStorage,
        HiCacheStorageConfig=HiCacheStorageConfig,
        HiCacheStorageExtraInfo=HiCacheStorageExtraInfo,
        KVBufferLayout=KVBufferLayout,
        KVBuffers=KVBuffers,
        MHABufferInfo=MHABufferInfo,
        MLABufferInfo=MLABufferInfo,
        MHATokenToKVPoolHost=MHATokenToKVPoolHost,
        MLATokenToKVPoolHost=MLATokenToKVPoolHost,
        StorageBackendFactory=StorageBackendFactory,
    )


def mha_pool(
    layout: str,
    *,
    dtype: Any = None,
    layers: int = 2,
    heads: int = 2,
    head_dim: int = 16,
    page_size: int = 4,
    device_pages: int = 8,
    ratio: float = 2.0,
) -> Any:
    """A real ``MHATokenToKVPoolHost`` of ``layout`` over CPU device buffers
    (host pages: ``ratio x device_pages`` plus SGLang's padding page)."""
    import torch

    sg = import_sglang()
    dtype = torch.bfloat16 if dtype is None else dtype
    tokens = device_pages * page_size
    k = tuple(torch.zeros(tokens + page_size, heads, head_dim, dtype=dtype) for _ in range(layers))
    v = tuple(torch.zeros(tokens + page_size, heads, head_dim, dtype=dtype) for _ in range(layers))
    info = sg.MHABufferInfo(
        buffers=sg.KVBuffers(
            k=k,
            v=v,
            k_data_ptrs=torch.tensor([t.data_ptr() for t in k], dtype=torch.uint64),
            v_data_ptrs=torch.tensor([t.data_ptr() for t in v], dtype=torch.uint64),
            layout=sg.KVBufferLayout.NHD,
        ),
        page_size=page_size,
        head_num=heads,
        head_dim=head_dim,
        v_head_dim=head_dim,
        dtype=dtype,
        device=torch.device("cpu"),
    )
    return sg.MHATokenToKVPoolHost(
        info, ratio, 0, page_size, layout, pin_memory=False, device="cpu",
        device_capacity_tokens=tokens, start_layer=0, end_layer=layers,
    )


def mla_pool(
    layout: str,
    *,
    dtype: Any = None,
    layers: int = 2,
    kv_lora_rank: int = 32,
    rope_dim: int = 16,
    page_size: int = 4,
    device_pages: int = 8,
    ratio: float = 2.0,
) -> Any:
    """A real ``MLATokenToKVPoolHost`` of ``layout`` over CPU device buffers."""
    import torch

    sg = import_sglang()
    dtype = torch.bfloat16 if dtype is None else dtype
    tokens = device_pages * page_size
    width = kv_lora_rank + rope_dim
    bufs = tuple(torch.zeros(tokens + page_size, 1, width, dtype=dtype) for _ in range(layers))
    info = sg.MLABufferInfo(
        buffers=bufs,
        data_ptrs=torch.tensor([t.data_ptr() for t in bufs], dtype=torch.uint64),
        layer_indices=tuple(range(layers)),
        device_layer_num=layers,
        page_size=page_size,
        kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=rope_dim,
        kv_cache_dim=width,
        dtype=dtype,
        device=torch.device("cpu"),
    )
    return sg.MLATokenToKVPoolHost(
        info, ratio, 0, page_size, layout, pin_memory=False, device="cpu",
        device_capacity_tokens=tokens, start_layer=0, end_layer=layers,
        target_layer_num=layers,
    )


def storage_config(
    extra: dict[str, Any] | None,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    is_mla: bool = False,
    model_name: str = "acme/tiny-chat",
    page_first: bool = False,
) -> Any:
    """SGLang's ``HiCacheStorageConfig`` as its controller builds it."""
    sg = import_sglang()
    return sg.HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1,
        attn_cp_rank=0, attn_cp_size=1, is_mla_model=is_mla,
        enable_storage_metrics=True, is_page_first_layout=page_first,
        model_name=model_name, extra_config=None if extra is None else dict(extra),
    )


def attach(backend_name: str, config: Any, pool: Any) -> Any:
    """What SGLang's ``attach_storage_backend`` does: the factory, then the
    host pool's registration."""
    sg = import_sglang()
    backend = sg.StorageBackendFactory.create_backend(backend_name, config, pool)
    backend.register_mem_pool_host(pool)
    backend.on_host_pools_registered()
    return backend


def fstier_backend(root: Any, pool: Any, **kw: Any) -> Any:
    """FstierHiCacheStorage through SGLang's ``dynamic`` factory path."""
    extra = {**FSTIER_EXTRA, "root_dir": str(root), **kw.pop("options", {})}
    return attach("dynamic", storage_config(extra, page_first=pool.layout == "page_first", **kw), pool)


def file_backend(root: Any, pool: Any, **kw: Any) -> Any:
    """SGLang's built-in ``HiCacheFile`` (the ``file`` backend) at ``root``."""
    extra = {"file_storage_path": str(root)}
    return attach("file", storage_config(extra, page_first=pool.layout == "page_first", **kw), pool)


def fill_pages(pool: Any, host_indices: Any, seed: int) -> None:
    """Random bytes in every page ``host_indices`` names (all fragments)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    flat = pool.kv_buffer.view(-1).view(torch.uint8)
    ptrs, sizes = pool.get_page_buffer_meta(host_indices)
    base = pool.kv_buffer.data_ptr()
    for ptr, size in zip(ptrs, sizes, strict=True):
        off = ptr - base
        flat[off : off + size] = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)


def page_bytes(pool: Any, host_indices: Any) -> list[bytes]:
    """The bytes of each page ``host_indices`` names, fragments in order."""
    import torch

    flat = pool.kv_buffer.view(-1).view(torch.uint8)
    ptrs, sizes = pool.get_page_buffer_meta(host_indices)
    base = pool.kv_buffer.data_ptr()
    per_page = len(ptrs) // (host_indices.numel() // pool.page_size)
    out: list[bytes] = []
    for i in range(0, len(ptrs), per_page):
        out.append(
            b"".join(
                flat[p - base : p - base + s].numpy().tobytes()
                for p, s in zip(ptrs[i : i + per_page], sizes[i : i + per_page], strict=True)
            )
        )
    return out


def page_keys(n: int, salt: str = "") -> list[str]:
    """``n`` SGLang-style page keys (64 hex digits each, chained)."""
    import hashlib

    keys: list[str] = []
    prev = salt.encode()
    for i in range(n):
        prev = hashlib.sha256(prev + i.to_bytes(8, "little")).digest()
        keys.append(prev.hex())
    return keys
