import ctypes
import mmap
import struct
import unittest

from pdrouter_kv import control
from tests.kvproxy_proc import KVProxy

PAGE = 4096


class InterleaveTest(unittest.TestCase):
    def test_matches_struct_packing(self):
        srcs, dsts, lens = [1, 2 ** 64 - 1, 3], [4, 5, 6], [7, 8, 2 ** 40]
        want = b"".join(struct.pack("<QQQ", *t) for t in zip(srcs, dsts, lens))
        self.assertEqual(control._interleave("Q", srcs, dsts, lens), want)
        self.assertEqual(control._interleave(control._U32_CODE, [1, 2], [3, 2 ** 32 - 1]), struct.pack("<IIII", 1, 3, 2, 2 ** 32 - 1))

    def test_refuses_out_of_range_and_short_columns(self):
        with self.assertRaises(OverflowError):
            control._interleave("Q", [-1], [0])
        with self.assertRaises(OverflowError):
            control._interleave(control._U32_CODE, [2 ** 32], [0])
        with self.assertRaises(ValueError):
            control._interleave("Q", [1, 2], [3])


class WriteFrameTest(unittest.TestCase):
    def test_few_and_many_triples_encode_alike(self):
        for n in (1, control._PACK_TRIPLES, control._PACK_TRIPLES + 1):
            srcs, dsts, lens = list(range(n)), [2 ** 64 - 1 - i for i in range(n)], [64] * n
            op, body = control.write_frame("p:1", srcs, dsts, lens)
            self.assertEqual(op, control.OP_WRITE)
            self.assertEqual(body, control._string("p:1") + struct.pack("<I", n) + control._interleave("Q", srcs, dsts, lens))

    def test_refuses_what_is_no_u64(self):
        for bad in (-1, 2 ** 64, 1.5, "1"):
            with self.subTest(bad=bad), self.assertRaises(ValueError):
                control.write_frame("p:1", [bad], [0], [1])


class WritePagesTest(unittest.TestCase):
    """Page writes between two engines' host memory through two real kvproxies."""

    @classmethod
    def setUpClass(cls):
        cls.kp = [KVProxy("prefill"), KVProxy("decode")]
        cls.src_cl, cls.dst_cl = control.Client(cls.kp[0].sock), control.Client(cls.kp[1].sock)
        cls.peer, _ = cls.dst_cl.hello()
        cls.maps, cls.src, cls.dst = [], [], []
        for b in range(2):
            for side, cl in ((cls.src, cls.src_cl), (cls.dst, cls.dst_cl)):
                m = mmap.mmap(-1, 8 * PAGE)
                cls.maps.append(m)
                buf = (ctypes.c_char * (8 * PAGE)).from_buffer(m)
                cl.register_host_memory(ctypes.addressof(buf), 8 * PAGE)
                side.append(buf)

    @classmethod
    def tearDownClass(cls):
        cls.src_cl.close()
        cls.dst_cl.close()
        for k in cls.kp:
            k.stop()

    def setUp(self):
        for b, buf in enumerate(self.src):
            for i in range(8):
                ctypes.memset(ctypes.addressof(buf) + i * PAGE, 16 * i + b + 1, PAGE)
        for buf in self.dst:
            ctypes.memset(buf, 0, 8 * PAGE)

    def buffers(self):
        # Buffer 1 has half-size pages: page i starts i * 2048 into it.
        return [(ctypes.addressof(self.src[0]), ctypes.addressof(self.dst[0]), PAGE),
                (ctypes.addressof(self.src[1]), ctypes.addressof(self.dst[1]), PAGE // 2)]

    def check(self, src_pages, dst_pages):
        for b, (_, _, n) in enumerate(self.buffers()):
            want = bytearray(8 * PAGE)
            for s, d in zip(src_pages, dst_pages):
                want[d * n:(d + 1) * n] = self.src[b].raw[s * n:(s + 1) * n]
            self.assertEqual(self.dst[b].raw, bytes(want), "buffer %d" % b)

    def test_hello_lists_write_pages(self):
        self.assertTrue(self.dst_cl.features & control.FEATURE_WRITE_PAGES)

    def test_pages_land_where_the_pairs_say(self):
        self.src_cl.write_pages(self.peer, self.buffers(), [0, 2, 6], [1, 3, 7])
        self.check([0, 2, 6], [1, 3, 7])

    def test_falls_back_to_triples_on_an_older_kvproxy(self):
        cl = control.Client(self.kp[0].sock)
        try:
            cl.features = 0  # as an older kvproxy's Hello leaves it
            cl.write_pages(self.peer, self.buffers(), [5, 1], [0, 4])
            self.check([5, 1], [0, 4])
            self.assertEqual(cl.features, 0)
        finally:
            cl.close()

    def test_page_past_the_registration_fails_and_moves_nothing(self):
        with self.assertRaisesRegex(control.KVProxyError, "not registered"):
            self.src_cl.write_pages(self.peer, self.buffers(), [0, 8], [0, 1])
        self.check([], [])

    def test_bad_arguments(self):
        w = self.src_cl.write_pages
        with self.assertRaisesRegex(ValueError, "2 source pages, 1 destination"):
            w(self.peer, self.buffers(), [0, 1], [0])
        with self.assertRaisesRegex(ValueError, "each buffer"):
            w(self.peer, [(1, 2)], [0], [0])
        with self.assertRaisesRegex(ValueError, "unsigned 32-bit"):
            w(self.peer, self.buffers(), [2 ** 32], [0])
        with self.assertRaisesRegex(ValueError, "at most"):
            w(self.peer, [(0, 0, 1)] * 2, range(control.MAX_PAGE_WRITE // 2 + 1), range(control.MAX_PAGE_WRITE // 2 + 1))
        with self.assertRaisesRegex(ValueError, "do not fit one frame"):
            w(self.peer, [(0, 0, 1)] * (control.MAX_FRAME // 24), [0], [0])
        self.assertTrue(self.src_cl.alive())

    def test_page_write_past_one_frame_goes_in_several(self):
        # One buffer of MAX_PAGE_WRITE one-byte pages: its frame passes
        # kvproxy's 16 MiB, which would drop the connection and its memory.
        n = control.MAX_PAGE_WRITE
        src_cl, dst_cl = control.Client(self.kp[0].sock), control.Client(self.kp[1].sock)
        try:
            bufs = []
            for cl in (src_cl, dst_cl):
                m = mmap.mmap(-1, n)
                self.maps.append(m)
                buf = (ctypes.c_char * n).from_buffer(m)
                cl.register_host_memory(ctypes.addressof(buf), n)
                bufs.append(buf)
            src, dst = bufs
            for i in range(0, n, PAGE):
                src[i] = bytes([i // PAGE % 251 + 1])
            src_cl.write_pages(self.peer, [(ctypes.addressof(src), ctypes.addressof(dst), 1)], range(n), range(n))
            self.assertTrue(src_cl.alive())
            self.assertEqual(dst.raw, src.raw)
        finally:
            src_cl.close()
            dst_cl.close()

    def test_largest_write_with_the_longest_peer_fits_a_frame(self):
        # A frame past kvproxy's 16 MiB closes the connection; MAX_TRIPLES
        # triples to a 4 KiB peer name must fit one.
        cl = control.Client(self.kp[0].sock)
        try:
            n = control.MAX_TRIPLES
            with self.assertRaises(control.KVProxyError):
                cl.write("1" * control.MAX_STRING, [1] * n, [1] * n, [1] * n)
            self.assertTrue(cl.alive())
        finally:
            cl.close()

    def test_a_timeout_of_years_is_a_long_wait_not_an_error(self):
        # poll() and Event.wait() take at most ~24 days (and no infinity).
        for timeout in (1e9, float("inf")):
            cl = control.Client(self.kp[1].sock, timeout=timeout)
            try:
                self.assertEqual(cl.hello()[0], self.peer)
            finally:
                cl.close()

    def test_write_past_a_mebibyte_frame(self):
        # 60k triples (1.4 MB) go in one frame now that the client takes kvproxy's 16 MiB.
        n = 60000
        a, b = ctypes.addressof(self.src[0]), ctypes.addressof(self.dst[0])
        self.src_cl.write(self.peer, [a + (i % PAGE) for i in range(n)], [b + (i % PAGE) for i in range(n)], [1] * n)
        self.assertEqual(self.dst[0].raw[:PAGE], self.src[0].raw[:PAGE])
        self.assertEqual(self.dst[0].raw[PAGE:], bytes(7 * PAGE))


if __name__ == "__main__":
    unittest.main()
