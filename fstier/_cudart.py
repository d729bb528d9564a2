"""The few CUDA runtime calls torch does not expose, through ctypes.

:class:`~fstier.gpu_copy.RankStager` moves a rank's share of a canonical page
with the copy engine: one ``cudaMemcpy2DAsync`` per uniform run of fragments
(rows of ``width`` bytes at a fixed pitch on each side), queued on the stager's
stream. ``torch.Tensor.copy_`` cannot do that: a strided host side makes it
copy through a temporary and synchronise. The library is the ``libcudart``
torch itself loaded (found in ``/proc/self/maps``), so streams and pointers
are the same objects torch uses. Also here: pinning host memory
(:func:`pin_host`, portable and mapped, through torch's binding) and a
tensor over raw device memory (:func:`device_view`), for
:class:`~fstier.layout.PoolTensors` and the stager's cross-allocation
views. The runtime is loaded on first use, never at import.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

import torch

__all__ = ["CudaRuntime", "cudart", "device_view", "pin_host", "unpin_host"]

#: cudaMemcpyDefault: the direction follows from the pointers (unified addressing).
_MEMCPY_DEFAULT = 4
#: cudaHostRegisterPortable | cudaHostRegisterMapped
_REGISTER_PORTABLE_MAPPED = 0x1 | 0x2
#: cudaDevAttrCanUseHostPointerForRegisteredMem
_ATTR_HOST_POINTER_FOR_REGISTERED = 91

_lock = threading.Lock()
_instance: CudaRuntime | None = None


def _find_library() -> str:
    # The copy torch loaded: same runtime, same primary context, same streams.
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip("\n").split(" ")[-1]
                if "/libcudart.so" in path:
                    return path
    except OSError:
        pass
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            ctypes.CDLL(name)
            return name
        except OSError:
            continue
    found = ctypes.util.find_library("cudart")
    if found:
        return found
    raise RuntimeError(
        "fstier: CUDA is available to torch but no libcudart could be loaded; install the CUDA "
        "runtime torch was built with (e.g. the nvidia-cuda-runtime wheel)"
    )


class CudaRuntime:
    """Thin, checked wrappers; every failure raises with the call and CUDA's message."""

    def __init__(self, path: str) -> None:
        self.path = path
        lib = ctypes.CDLL(path)
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        lib.cudaMemcpy2DAsync.argtypes = [vp, sz, vp, sz, sz, sz, ctypes.c_int, vp]
        lib.cudaMemcpy2DAsync.restype = ctypes.c_int
        lib.cudaMemcpyAsync.argtypes = [vp, vp, sz, ctypes.c_int, vp]
        lib.cudaMemcpyAsync.restype = ctypes.c_int
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.cudaHostGetDevicePointer.argtypes = [ctypes.POINTER(vp), vp, ctypes.c_uint]
        lib.cudaHostGetDevicePointer.restype = ctypes.c_int
        lib.cudaDeviceGetAttribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
        lib.cudaDeviceGetAttribute.restype = ctypes.c_int
        self._lib = lib

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            msg = self._lib.cudaGetErrorString(rc)
            raise RuntimeError(f"fstier: {what} failed with CUDA error {rc} ({msg.decode() if msg else '?'})")

    def memcpy_2d_async(
        self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, stream: int
    ) -> None:
        """``height`` rows of ``width`` bytes; contiguous copies take the 1-d call."""
        if height == 1 or (dpitch == width and spitch == width):
            rc = self._lib.cudaMemcpyAsync(dst, src, width * height, _MEMCPY_DEFAULT, stream)
            self._check(rc, f"cudaMemcpyAsync({width * height} bytes)")
        else:
            rc = self._lib.cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, _MEMCPY_DEFAULT, stream)
            self._check(rc, f"cudaMemcpy2DAsync({height} rows of {width} bytes, pitches {dpitch}/{spitch})")

    def host_device_pointer(self, host_ptr: int, device: int) -> int:
        """Device address of registered host memory (the host address under UVA)."""
        val = ctypes.c_int(0)
        self._check(
            self._lib.cudaDeviceGetAttribute(ctypes.byref(val), _ATTR_HOST_POINTER_FOR_REGISTERED, device),
            "cudaDeviceGetAttribute(CanUseHostPointerForRegisteredMem)",
        )
        if val.value:
            return host_ptr
        out = ctypes.c_void_p()
        self._check(self._lib.cudaHostGetDevicePointer(ctypes.byref(out), host_ptr, 0), "cudaHostGetDevicePointer")
        return int(out.value or 0)


def cudart() -> CudaRuntime:
    """The process's runtime wrapper (created on first use, after torch initialised CUDA)."""
    global _instance
    with _lock:
        if _instance is None:
            torch.cuda.init()
            _instance = CudaRuntime(_find_library())
        return _instance


def pin_host(ptr: int, size: int) -> bool:
    """Register ``size`` bytes at ``ptr`` with CUDA, portable (pinned for every
    context of this process) and mapped (kernels may read and write it in
    place). False where CUDA refuses (the caller stays unpinned)."""
    return int(torch.cuda.cudart().cudaHostRegister(ptr, size, _REGISTER_PORTABLE_MAPPED)) == 0


def unpin_host(ptr: int) -> None:
    """Undo :func:`pin_host` (before the memory is unmapped)."""
    torch.cuda.cudart().cudaHostUnregister(ptr)


class _RawDevice:
    """``__cuda_array_interface__`` of ``size`` bytes of device memory at
    ``ptr`` that something else owns (``owner`` is kept alive with it)."""

    def __init__(self, ptr: int, size: int, owner: object = None) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": (size,), "typestr": "|u1", "data": (ptr, False), "strides": None, "version": 3,
        }


def device_view(ptr: int, size: int, device: torch.device, owner: object = None) -> torch.Tensor:
    """A uint8 tensor on ``device`` over ``size`` bytes at device address
    ``ptr`` (no copy, no ownership: ``owner`` stays alive while it lives)."""
    with torch.cuda.device(device):
        return torch.as_tensor(_RawDevice(ptr, size, owner), device=device)
