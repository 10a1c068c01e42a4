import ctypes
import logging
import mmap
import os
import threading
import time
import unittest

from mooncake.engine import TransferEngine
from pdrouter_kv import control, engine as eng
from tests.kvproxy_proc import KVProxy

MiB = 1 << 20
# The engine logs each refused call; the tests check the return codes instead.
logging.getLogger("pdrouter_kv").setLevel(logging.CRITICAL)


_maps = []


def buffer(size, fill=0, offset=0):
    """An ordinary private buffer at offset into pages of its own: two
    engines of one test process must not remap the same page (two engines of
    one real process don't exist: SGLang shares one)."""
    m = mmap.mmap(-1, offset + size + mmap.PAGESIZE)
    _maps.append(m)
    b = (ctypes.c_char * size).from_buffer(m, offset)
    if fill:
        ctypes.memset(b, fill, size)
    return b


def carve(size, count, fill=None):
    """count buffers of size bytes packed back to back on shared pages."""
    m = mmap.mmap(-1, size * count + mmap.PAGESIZE)
    _maps.append(m)
    out = []
    for i in range(count):
        b = (ctypes.c_char * size).from_buffer(m, i * size)
        if fill is not None:
            ctypes.memset(b, fill(i), size)
        out.append(b)
    return out


def engine_on(kp):
    os.environ["PDROUTER_KVPROXY_SOCK"] = kp.sock
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    return e


class WithoutKVProxyTest(unittest.TestCase):
    def test_initialize_without_kvproxy_fails_with_a_negative_code(self):
        os.environ["PDROUTER_KVPROXY_SOCK"] = "/nonexistent/kvproxy.sock"
        e = TransferEngine()
        self.assertEqual(e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", ""), -1)
        self.assertEqual(e.get_rpc_port(), -1)

    def test_calls_before_initialize_fail(self):
        e = TransferEngine()
        b = buffer(4096)
        self.assertLess(e.register_memory(ctypes.addressof(b), 4096), 0)
        self.assertLess(e.transfer_sync_write("127.0.0.1:1", ctypes.addressof(b), 1, 16), 0)
        self.assertLess(e.send_probe("127.0.0.1:1"), 0)

    def test_bad_arguments_raise_clear_errors(self):
        e = TransferEngine()
        with self.assertRaisesRegex(TypeError, "local_hostname"):
            e.initialize(None, "P2PHANDSHAKE", "tcp", "")
        with self.assertRaisesRegex(TypeError, "buffer_addresses"):
            e.batch_register_memory("0x1000", [1])
        with self.assertRaisesRegex(TypeError, "capacities: want int"):
            e.batch_register_memory([4096], [1.5])
        with self.assertRaisesRegex(ValueError, "2 addresses, 1 capacities"):
            e.batch_register_memory([4096, 8192], [1])
        with self.assertRaisesRegex(ValueError, "1 buffers, 0 peer addresses, 1 lengths"):
            e.batch_transfer_sync_write("127.0.0.1:1", [4096], [], [16])
        with self.assertRaisesRegex(TypeError, "session_id"):
            e.transfer_sync_write(1234, 4096, 4096, 16)

    def test_write_request_validation(self):
        with self.assertRaisesRegex(ValueError, "unsigned 64-bit"):
            # Encoding happens before anything is sent, so no kvproxy is needed.
            control.Client.write(_NoSend(), "p", [-1], [0], [1])


class _NoSend:
    def _call(self, *a, **k):
        raise AssertionError("must not send")

    _routes = {}  # no peer asked yet

    def _direct_fits(self, *a):
        return False  # no memory registered: nothing goes direct


class EnginePairTest(unittest.TestCase):
    """A prefill and a decode kvproxy per class, a TransferEngine on each per
    test, and no region left in either kvproxy after the engines close."""

    @classmethod
    def setUpClass(cls):
        cls.kp = [KVProxy("prefill"), KVProxy("decode")]

    @classmethod
    def tearDownClass(cls):
        for k in cls.kp:
            k.stop()

    def setUp(self):
        self.src_eng = engine_on(self.kp[0])
        self.dst_eng = engine_on(self.kp[1])

    def tearDown(self):
        self.src_eng.close()
        self.dst_eng.close()
        for k in self.kp:
            self.assertEqual(k.wait_metric("kvproxy_registered_regions", 0), 0, "regions left in kvproxy after close")


class EngineTest(EnginePairTest):

    def pair(self, size, fill=0x11):
        src, dst = buffer(size, fill), buffer(size)
        self.assertEqual(self.src_eng.register_memory(ctypes.addressof(src), size), 0)
        self.assertEqual(self.dst_eng.register_memory(ctypes.addressof(dst), size), 0)
        return src, dst

    def test_rpc_port_names_the_kvproxy_peer_listener(self):
        self.assertEqual("127.0.0.1:%d" % self.src_eng.get_rpc_port(), self.kp[0].peer)
        self.assertIs(self.src_eng.get_engine(), self.src_eng)

    def test_write_moves_bytes_into_the_peer_engines_memory(self):
        size = 3 * MiB + 100
        src, dst = buffer(size, offset=123), buffer(size, offset=4000)
        for i in range(0, size, 4096):
            src[i] = bytes([i // 4096 % 251])
        before = src.raw
        sp, dp = ctypes.addressof(src), ctypes.addressof(dst)
        self.assertEqual(self.src_eng.batch_register_memory([sp], [size]), 0)
        self.assertEqual(self.dst_eng.register_memory(dp, size), 0)
        # Registration kept both buffers' addresses and contents.
        self.assertEqual((ctypes.addressof(src), ctypes.addressof(dst)), (sp, dp))
        self.assertEqual(src.raw, before)
        self.assertEqual(self.kp[0].metric("kvproxy_registered_regions"), 1)
        # SGLang's shape: many ranges, some contiguous (merged by kvproxy).
        half = size // 2
        srcs, dsts, lens = [sp, sp + 4096, sp + half], [dp, dp + 4096, dp + half], [4096, half - 4096, size - half]
        self.assertEqual(self.src_eng.batch_transfer_sync_write(self.dst_eng_session(), srcs, dsts, lens), 0)
        self.assertEqual(dst.raw, before)
        self.assertEqual(self.src_eng.transfer_sync_write(self.dst_eng_session(), sp, dp + 8, 0), 0)
        self.assertEqual(self.src_eng.batch_transfer_sync_write(self.dst_eng_session(), [], [], []), 0)

    def dst_eng_session(self):
        return "127.0.0.1:%d" % self.dst_eng.get_rpc_port()

    def test_unregistered_addresses_are_rejected(self):
        src, dst = self.pair(64 * 1024)
        sp, dp = ctypes.addressof(src), ctypes.addressof(dst)
        other = buffer(8192)
        # Source outside this engine's registrations: refused before sending.
        self.assertEqual(self.src_eng.transfer_sync_write(self.dst_eng_session(), ctypes.addressof(other), dp, 16), -1)
        # Destination outside the peer's registrations: kvproxy refuses it, nothing moves.
        self.assertEqual(self.src_eng.transfer_sync_write(self.dst_eng_session(), sp, dp + 10 * MiB, 16), -1)
        self.assertEqual(self.src_eng.transfer_sync_write(self.dst_eng_session(), sp, dp + 64 * 1024 - 8, 4096), -1)
        self.assertEqual(dst.raw, b"\0" * len(dst))
        self.assertEqual(self.src_eng.unregister_memory(ctypes.addressof(other)), eng.ERR_ADDRESS_NOT_REGISTERED)

    def test_register_codes_match_mooncake(self):
        b = buffer(8192)
        p = ctypes.addressof(b)
        self.assertEqual(self.src_eng.register_memory(p, 8192), 0)
        self.assertEqual(self.src_eng.register_memory(p, 8192), eng.ERR_ADDRESS_OVERLAPPED)
        self.assertEqual(self.src_eng.register_memory(p + 100, 10), eng.ERR_ADDRESS_OVERLAPPED)
        self.assertEqual(self.src_eng.register_memory(p + 8192 * 4, 0), eng.ERR_INVALID_ARGUMENT)
        self.assertEqual(self.src_eng.batch_register_memory([], []), 0)
        self.assertEqual(self.src_eng.unregister_memory(p), 0)
        self.assertEqual(self.kp[0].wait_metric("kvproxy_registered_regions", 0), 0)

    def test_an_unregister_kvproxy_refuses_does_not_skip_the_rest(self):
        a, b = buffer(4096), buffer(4096)
        pa, pb = ctypes.addressof(a), ctypes.addressof(b)
        self.assertEqual(self.src_eng.batch_register_memory([pa, pb], [4096, 4096]), 0)
        self.assertEqual(self.kp[0].metric("kvproxy_registered_regions"), 2)
        # kvproxy loses the first region (by address, the order the engine
        # unregisters in) behind the engine's back: its unregister fails.
        self.src_eng._client.unregister_memory(min(pa, pb))
        self.assertEqual(self.src_eng.batch_unregister_memory([pa, pb]), -1)
        self.assertEqual(self.kp[0].metric("kvproxy_registered_regions"), 0, "the other region left in kvproxy")

    def test_small_buffers_on_shared_pages(self):
        # SGLang's aux buffers are small tensors that share pages: each is
        # registered on its own, kvproxy sees them as one remapped region.
        n = 12
        bufs = carve(200, n, lambda i: i + 1)
        dsts = carve(200, n)
        self.assertEqual(self.src_eng.batch_register_memory([ctypes.addressof(b) for b in bufs[:6]], [200] * 6), 0)
        for b in bufs[6:]:
            self.assertEqual(self.src_eng.register_memory(ctypes.addressof(b), 200), 0)
        self.assertEqual(self.dst_eng.batch_register_memory([ctypes.addressof(b) for b in dsts], [200] * n), 0)
        for i, b in enumerate(bufs):
            self.assertEqual(b.raw, bytes([i + 1]) * 200, "registration changed buffer %d" % i)
        ret = self.src_eng.batch_transfer_sync_write(self.dst_eng_session(), [ctypes.addressof(b) for b in bufs], [ctypes.addressof(b) for b in dsts], [200] * n)
        self.assertEqual(ret, 0)
        for i, d in enumerate(dsts):
            self.assertEqual(d.raw, bytes([i + 1]) * 200)
        # Unregistering one keeps its page-mates usable.
        self.assertEqual(self.dst_eng.unregister_memory(ctypes.addressof(dsts[0])), 0)
        ctypes.memset(dsts[1], 0, 200)
        self.assertEqual(self.src_eng.transfer_sync_write(self.dst_eng_session(), ctypes.addressof(bufs[1]), ctypes.addressof(dsts[1]), 200), 0)
        self.assertEqual(dsts[1].raw, bytes([2]) * 200)

    def test_failed_remap_keeps_the_buffers_on_its_pages_registered(self):
        # b shares a's page and runs into a page that cannot be read, so the
        # remap of their union fails: a must stay as it was.
        m = mmap.mmap(-1, 4 * mmap.PAGESIZE)
        _maps.append(m)
        base = ctypes.addressof(ctypes.c_char.from_buffer(m))
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        last = base + 3 * mmap.PAGESIZE
        self.assertEqual(libc.mprotect(last, mmap.PAGESIZE, 0), 0)  # PROT_NONE
        self.addCleanup(libc.mprotect, last, mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_WRITE)
        ctypes.memset(base, 5, 100)
        dst = buffer(100)
        self.assertEqual(self.dst_eng.register_memory(ctypes.addressof(dst), 100), 0)
        self.assertEqual(self.src_eng.register_memory(base, 100), 0)
        self.assertLess(self.src_eng.register_memory(base + 200, 3 * mmap.PAGESIZE), 0)
        self.assertEqual(self.kp[0].metric("kvproxy_registered_regions"), 1)
        self.assertEqual(self.src_eng.transfer_sync_write(self.dst_eng_session(), base, ctypes.addressof(dst), 100), 0)
        self.assertEqual(dst.raw, b"\5" * 100)

    def test_four_threads_write_at_once(self):
        size = 8 * MiB
        src, dst = self.pair(size, 0)
        sp, dp = ctypes.addressof(src), ctypes.addressof(dst)
        for t in range(4):
            ctypes.memset(sp + t * size // 4, t + 1, size // 4)
        rets = [None] * 4

        def work(t):
            base = t * size // 4
            page = 64 * 1024
            offs = list(range(base, base + size // 4, page))
            rets[t] = [self.src_eng.batch_transfer_sync_write(self.dst_eng_session(), [sp + o for o in offs], [dp + o for o in offs], [page] * len(offs)) for _ in range(5)]

        ths = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for th in ths:
            th.start()
        for th in ths:
            th.join(60)
        self.assertEqual(rets, [[0] * 5] * 4)
        self.assertEqual(dst.raw, src.raw)

    def test_dead_peer_fails_fast(self):
        src, _ = self.pair(4096)
        t0 = time.time()
        self.assertEqual(self.src_eng.transfer_sync_write("127.0.0.1:1", ctypes.addressof(src), 4096, 16), -1)
        self.assertEqual(self.src_eng.send_probe("127.0.0.1:1"), eng.ERR_SOCKET)
        self.assertLess(time.time() - t0, 12)
        self.assertEqual(self.src_eng.send_probe(self.dst_eng_session()), 0)

    def test_peer_engine_gone_fails_writes_and_frees_its_memory(self):
        src, dst = self.pair(64 * 1024)
        self.assertEqual(self.kp[1].metric("kvproxy_registered_regions"), 1)
        self.dst_eng.close()
        self.assertEqual(self.kp[1].wait_metric("kvproxy_registered_regions", 0), 0)
        self.assertEqual(self.src_eng.transfer_sync_write(self.dst_eng_session_cached, ctypes.addressof(src), ctypes.addressof(dst), 16), -1)

    def test_overlong_session_id_fails_the_call_not_the_connection(self):
        # kvproxy drops a connection whose frame holds a string over 4 KiB,
        # and with it every region the engine registered.
        src, dst = self.pair(4096)
        client = self.src_eng._client
        long_id = "127.0.0.1:" + "9" * 5000
        self.assertLess(self.src_eng.send_probe(long_id), 0)
        self.assertLess(self.src_eng.transfer_sync_write(long_id, ctypes.addressof(src), ctypes.addressof(dst), 16), 0)
        self.assertIs(self.src_eng._client, client)
        self.assertTrue(client.alive(0.2))
        self.assertEqual(self.src_eng.transfer_sync_write(self.dst_eng_session(), ctypes.addressof(src), ctypes.addressof(dst), 16), 0)

    @property
    def dst_eng_session_cached(self):
        return self.kp[1].peer


class KVProxyDeathTest(unittest.TestCase):
    def test_dead_kvproxy_fails_calls_and_a_restarted_one_serves_again(self):
        a, b = KVProxy("prefill"), KVProxy("decode")
        try:
            src_eng, dst_eng = engine_on(a), engine_on(b)
            src, dst = buffer(1 << 16, 7), buffer(1 << 16)
            self.assertEqual(src_eng.register_memory(ctypes.addressof(src), 1 << 16), 0)
            self.assertEqual(dst_eng.register_memory(ctypes.addressof(dst), 1 << 16), 0)
            a.kill()
            t0 = time.time()
            self.assertEqual(src_eng.transfer_sync_write(b.peer, ctypes.addressof(src), ctypes.addressof(dst), 1 << 16), -1)
            self.assertLess(time.time() - t0, 5)
            self.assertEqual(dst.raw, b"\0" * (1 << 16))
            # A new kvproxy on the same socket: the engine registers again and works.
            a.start()
            fresh = engine_on(a)
            self.assertEqual(fresh.register_memory(ctypes.addressof(src), 1 << 16), 0)
            self.assertEqual(src.raw, b"\7" * (1 << 16))
            self.assertEqual(fresh.transfer_sync_write(b.peer, ctypes.addressof(src), ctypes.addressof(dst), 1 << 16), 0)
            self.assertEqual(dst.raw, b"\7" * (1 << 16))
            fresh.close()
            src_eng.close()
            dst_eng.close()
        finally:
            a.stop()
            b.stop()


if __name__ == "__main__":
    unittest.main()
