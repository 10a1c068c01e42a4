"""CUDA pointers for kvproxy's cuda memory kind, through the driver's
libcuda.so.1 with ctypes (no torch, no toolkit needed).

An engine's KV tensors (torch's caching allocator) are sub-ranges of
cudaMalloc'd segments; CUDA IPC handles name a whole allocation, so a
registration sends the handle of the allocation holding the pointer and the
pointer's offset in it (what torch.multiprocessing does with _share_cuda_).

    from pdrouter_kv import cuda
    if cuda.is_cuda_pointer(ptr):
        r = cuda.ipc_region(ptr)   # r.handle (64 bytes), r.base, r.offset, r.size, r.device
        body = cuda.register_body(ptr, length)  # kvproxy's OpRegisterMemory body, kind cuda
"""

import ctypes
import struct
import threading
from collections import namedtuple

HANDLE_SIZE = 64

_CU_POINTER_ATTRIBUTE_CONTEXT = 1
_CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2
_CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
_CU_MEMORYTYPE_DEVICE = 2
_CUDA_ERROR_INVALID_VALUE = 1

IpcRegion = namedtuple("IpcRegion", "handle base size offset device")


class CudaUnavailable(RuntimeError):
    """No CUDA driver could be loaded or initialised."""


class CudaError(RuntimeError):
    def __init__(self, op, code, text):
        super().__init__("%s: %s (%d)" % (op, text, code))
        self.op, self.code = op, code


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * HANDLE_SIZE)]


_lock = threading.Lock()
_lib = None
_lib_error = None


def _driver(libname="libcuda.so.1"):
    global _lib, _lib_error
    with _lock:
        if _lib is None and _lib_error is None:
            try:
                lib = ctypes.CDLL(libname)
                for name in ("cuInit", "cuPointerGetAttribute", "cuMemGetAddressRange_v2",
                             "cuIpcGetMemHandle", "cuCtxPushCurrent_v2", "cuCtxPopCurrent_v2",
                             "cuGetErrorString"):
                    getattr(lib, name).restype = ctypes.c_int
                lib.cuPointerGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
                lib.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64),
                                                        ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
                lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(_Handle), ctypes.c_uint64]
                r = lib.cuInit(0)
                if r != 0:
                    raise CudaUnavailable("cuInit failed (%d): no usable CUDA device" % r)
                _lib = lib
            except (OSError, AttributeError) as e:
                _lib_error = CudaUnavailable("no CUDA driver (%s)" % e)
            except CudaUnavailable as e:
                _lib_error = e
        if _lib is None:
            raise _lib_error
        return _lib


def available():
    """True when the CUDA driver loads and initialises."""
    try:
        _driver()
        return True
    except CudaUnavailable:
        return False


def _check(lib, op, r):
    if r != 0:
        s = ctypes.c_char_p()
        lib.cuGetErrorString(r, ctypes.byref(s))
        raise CudaError(op, r, (s.value or b"unknown CUDA error").decode())


def _ptr(ptr):
    if isinstance(ptr, bool) or not isinstance(ptr, int):
        raise TypeError("pointer must be an int, got %r" % type(ptr).__name__)
    if ptr <= 0:
        raise ValueError("bad pointer %#x" % ptr)
    return ptr


def is_cuda_pointer(ptr):
    """True if ptr is device memory; False for host memory or without a driver."""
    ptr = _ptr(ptr)
    try:
        lib = _driver()
    except CudaUnavailable:
        return False
    t = ctypes.c_uint(0)
    r = lib.cuPointerGetAttribute(ctypes.byref(t), _CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr)
    if r == _CUDA_ERROR_INVALID_VALUE:  # memory CUDA never saw: plain host memory
        return False
    _check(lib, "cuPointerGetAttribute", r)
    return t.value == _CU_MEMORYTYPE_DEVICE


def ipc_region(ptr):
    """The IPC handle of the allocation holding device pointer ptr, its base,
    size, ptr's offset from the base, and the device ordinal."""
    ptr = _ptr(ptr)
    lib = _driver()
    if not is_cuda_pointer(ptr):
        raise ValueError("%#x is not CUDA device memory" % ptr)
    ctx = ctypes.c_void_p()
    _check(lib, "cuPointerGetAttribute(CONTEXT)",
           lib.cuPointerGetAttribute(ctypes.byref(ctx), _CU_POINTER_ATTRIBUTE_CONTEXT, ptr))
    dev = ctypes.c_int(-1)
    _check(lib, "cuPointerGetAttribute(DEVICE_ORDINAL)",
           lib.cuPointerGetAttribute(ctypes.byref(dev), _CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr))
    # The handle calls need the pointer's context current on this thread.
    _check(lib, "cuCtxPushCurrent", lib.cuCtxPushCurrent_v2(ctx))
    try:
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        _check(lib, "cuMemGetAddressRange",
               lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr))
        h = _Handle()
        r = lib.cuIpcGetMemHandle(ctypes.byref(h), base.value)
        if r != 0:
            try:
                _check(lib, "cuIpcGetMemHandle", r)
            except CudaError as e:
                raise CudaError(e.op, e.code, str(e).split(": ", 1)[1] +
                                "; memory from cuMemCreate (e.g. PYTORCH_CUDA_ALLOC_CONF="
                                "expandable_segments:True) has no legacy IPC handle") from None
    finally:
        popped = ctypes.c_void_p()
        lib.cuCtxPopCurrent_v2(ctypes.byref(popped))
    return IpcRegion(ctypes.string_at(ctypes.addressof(h), HANDLE_SIZE), base.value, size.value,
                     ptr - base.value, dev.value)


_KIND_CUDA = 1


def register_body(ptr, length):
    """The body of kvproxy's OpRegisterMemory for device memory [ptr, ptr+length):
    kind, address, length, the allocation's IPC handle and ptr's offset in it."""
    if isinstance(length, bool) or not isinstance(length, int) or length <= 0:
        raise ValueError("bad length %r" % (length,))
    r = ipc_region(ptr)
    if r.offset + length > r.size:
        raise ValueError("[%#x,+%d) runs past its CUDA allocation [%#x,+%d)" % (ptr, length, r.base, r.size))
    return struct.pack("<BQQI", _KIND_CUDA, ptr, length, HANDLE_SIZE) + r.handle + struct.pack("<Q", r.offset)
