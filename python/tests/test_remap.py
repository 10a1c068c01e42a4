import ctypes
import mmap
import os
import unittest

from pdrouter_kv import remap


def buffer(size, fill):
    """An ordinary private buffer (what malloc/torch hand an engine)."""
    b = ctypes.create_string_buffer(size)
    ctypes.memset(b, fill, size)
    return b


class RemapTest(unittest.TestCase):
    def test_page_span_covers_the_range(self):
        P = remap.PAGE
        self.assertEqual(remap.page_span(P + 1, 10), (P, P))
        self.assertEqual(remap.page_span(P, P), (P, P))
        self.assertEqual(remap.page_span(P - 1, 2), (0, 2 * P))
        for bad in ((0, 1), (P, 0), (P, -1)):
            with self.assertRaises(ValueError):
                remap.page_span(*bad)
        with self.assertRaises(TypeError):
            remap.page_span("0x1000", 1)

    def test_merge_spans_joins_overlaps_only(self):
        self.assertEqual(remap.merge_spans([(8, 4), (0, 4), (2, 4)]), [(0, 6), (8, 4)])
        self.assertEqual(remap.merge_spans([(0, 4), (4, 4)]), [(0, 4), (4, 4)])
        self.assertEqual(remap.merge_spans([(0, 10), (2, 2)]), [(0, 10)])

    def test_remap_keeps_addresses_and_contents_and_shares_the_pages(self):
        size = 3 * remap.PAGE + 123
        b = buffer(size, 0x5A)
        ptr = ctypes.addressof(b)
        b[7] = b"\x01"
        start, span = remap.page_span(ptr, size)
        fd = remap.remap(start, span)
        try:
            self.assertEqual(ctypes.addressof(b), ptr)
            self.assertEqual(b.raw[:7], b"\x5a" * 7)
            self.assertEqual(b.raw[7], 1)
            self.assertEqual(b.raw[8:], b"\x5a" * (size - 8))
            # The pages are now the memfd's: another mapping of it sees the
            # engine's writes and the engine sees its writes.
            m = mmap.mmap(fd, span, mmap.MAP_SHARED)
            off = ptr - start
            self.assertEqual(m[off + 7], 1)
            b[100] = b"\x77"
            self.assertEqual(m[off + 100], 0x77)
            m[off + 200] = 0x33
            self.assertEqual(b.raw[200], 0x33)
            m.close()
        finally:
            os.close(fd)
        # The mapping outlives the fd.
        b[300] = b"\x44"
        self.assertEqual(b.raw[300], 0x44)

    def test_remap_rejects_unaligned(self):
        with self.assertRaises(ValueError):
            remap.remap(remap.PAGE + 1, remap.PAGE)
        with self.assertRaises(ValueError):
            remap.remap(remap.PAGE, 10)

    def test_remap_of_unmapped_memory_fails_cleanly(self):
        before = len(os.listdir("/proc/self/fd"))
        # Page 0 is never mapped: reading it for the copy fails with EFAULT.
        with self.assertRaises(OSError):
            remap.remap(remap.PAGE, remap.PAGE)
        self.assertEqual(len(os.listdir("/proc/self/fd")), before)


if __name__ == "__main__":
    unittest.main()
