"""The few CUDA runtime calls torch does not expose, through ctypes.

:class:`~fstier.gpu_copy.RankStager` moves a rank's share of a canonical page
with the copy engine: one ``cudaMemcpy2DAsync`` per uniform run of fragments
(rows of ``width`` bytes at a fixed pitch on each side), queued on the stager's
stream. ``torch.Tensor.copy_`` cannot do that: a strided host side makes it
copy through a temporary and synchronise. The library is the ``libcudart``
torch itself loaded (found in ``/proc/self/maps``), so streams and pointers
are the same objects torch uses. Nothing here is imported without CUDA.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

import torch

__all__ = ["CudaRuntime", "cudart"]

#: cudaMemcpyDefault: the direction follows from the pointers (unified addressing).
_MEMCPY_DEFAULT = 4
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
