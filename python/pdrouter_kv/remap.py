"""Turn an engine's ordinary memory into a shared mapping in place.

An engine allocates its KV buffers the ordinary way (torch CPU tensors, numpy
arrays: anonymous private pages) that no other process can reach. remap()
makes a range shareable without moving it: the bytes go into a memfd, and the
memfd is mapped MAP_SHARED|MAP_FIXED over the very same addresses. The
engine's pointers and contents stay as they were; the memfd can then be sent
to kvproxy, whose mapping of it sees (and writes) the engine's pages.

Caveats of doing it in place: a thread writing the range while it is remapped
loses its write (engines register at start-up, before any transfer), and a
fork() after it shares the pages with the child instead of copying them.
"""

import ctypes
import mmap
import os

PAGE = mmap.PAGESIZE

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.pwrite.restype = ctypes.c_ssize_t
_libc.pwrite.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_long]
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_FIXED = 0x10


def page_span(ptr, length):
    """Return (start, size) of the page-aligned range covering [ptr, ptr+length)."""
    if not isinstance(ptr, int) or not isinstance(length, int):
        raise TypeError("address and length must be int, got %s and %s" % (type(ptr).__name__, type(length).__name__))
    if ptr <= 0 or length <= 0:
        raise ValueError("address %#x length %d: both must be positive" % (ptr, length))
    start = ptr - ptr % PAGE
    end = -(-(ptr + length) // PAGE) * PAGE
    return start, end - start


def _oserror(what):
    err = ctypes.get_errno()
    return OSError(err, "%s: %s" % (what, os.strerror(err)))


def remap(start, size, name="pdrouter-kv"):
    """Back the page-aligned range [start, start+size) by a new memfd, in place.

    Returns the memfd (the caller closes it once it has been sent); the range
    keeps its contents. The range must be mapped, readable and writable.
    """
    if start % PAGE or size % PAGE or size <= 0:
        raise ValueError("remap: [%#x,+%d) is not page-aligned" % (start, size))
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        done = 0
        while done < size:
            n = _libc.pwrite(fd, start + done, size - done, done)
            if n <= 0:
                raise _oserror("remap: copy [%#x,+%d) into the memfd" % (start, size))
            done += n
        got = _libc.mmap(start, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | _MAP_FIXED, fd, 0)
        if got == _MAP_FAILED or got != start:
            raise _oserror("remap: map the memfd over [%#x,+%d)" % (start, size))
    except BaseException:
        os.close(fd)
        raise
    return fd


def merge_spans(spans):
    """Merge overlapping (start, size) spans into disjoint spans, sorted."""
    out = []
    for start, size in sorted(spans):
        if out and start < out[-1][0] + out[-1][1]:
            last_start, last_size = out[-1]
            out[-1] = (last_start, max(last_start + last_size, start + size) - last_start)
        else:
            out.append((start, size))
    return out
