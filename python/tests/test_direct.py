"""Small host writes that go straight to the peer kvproxy (pdrouter_kv.direct),
and those that go through kvproxy as before."""

import ctypes
import mmap
import socket
import threading
import time
import unittest

from pdrouter_kv import control, direct
from tests.kvproxy_proc import KVProxy

SIZE = 1 << 18


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Pair:
    """Two kvproxies on transport, an engine's client on each with SIZE bytes registered."""

    def __init__(self, transport="tcp", fixed_port=False):
        extra = ["--peer-port", str(free_port())] if fixed_port else []
        self.kp = [KVProxy("prefill", transport), KVProxy("decode", transport, extra=extra)]
        self.a, self.b = control.Client(self.kp[0].sock), control.Client(self.kp[1].sock)
        self.a.hello()
        self.peer, _ = self.b.hello()
        self.maps = [mmap.mmap(-1, SIZE) for _ in range(2)]
        self.src, self.dst = [(ctypes.c_char * SIZE).from_buffer(m) for m in self.maps]
        self.a.register_host_memory(ctypes.addressof(self.src), SIZE)
        self.b.register_host_memory(ctypes.addressof(self.dst), SIZE)

    def write(self, off, n, fill, dst_off=None, timeout=None):
        ctypes.memset(ctypes.addressof(self.src) + off, fill, n)
        d = off if dst_off is None else dst_off
        self.a.write(self.peer, [ctypes.addressof(self.src) + off], [ctypes.addressof(self.dst) + d], [n], timeout=timeout)

    def landed(self, off, n, fill):
        return self.dst[off:off + n] == bytes([fill]) * n

    def close(self):
        self.a.close()
        self.b.close()
        for k in self.kp:
            k.stop()
        del self.src, self.dst
        for m in self.maps:
            m.close()


class DirectTCPTest(unittest.TestCase):
    def setUp(self):
        self.p = Pair("tcp", fixed_port=True)
        self.addCleanup(self.p.close)

    def test_small_writes_go_direct(self):
        self.assertTrue(self.p.a.features & control.FEATURE_DIRECT_WRITE)
        for i in range(10):
            self.p.write(64 * i, 64, i + 1)
            self.assertTrue(self.p.landed(64 * i, 64, i + 1))
        self.assertEqual(self.p.a.direct_writes, 10)
        self.assertEqual(self.p.kp[1].metric("kvproxy_direct_writes_total"), 10)
        self.assertEqual(self.p.kp[1].metric("kvproxy_direct_clients"), 1)
        self.assertEqual(self.p.kp[0].metric("kvproxy_direct_routes"), 1)
        # The writing kvproxy moved none of them.
        self.assertEqual(self.p.kp[0].metric("kvproxy_memory_writes_total"), 0)

    def test_several_ranges_in_one_write(self):
        base_s, base_d = ctypes.addressof(self.p.src), ctypes.addressof(self.p.dst)
        ctypes.memset(base_s, 3, 3 * 4096)
        self.p.a.write(self.p.peer, [base_s + 4096 * i for i in range(3)], [base_d + 8192 * i for i in range(3)], [4096] * 3)
        for i in range(3):
            self.assertTrue(self.p.landed(8192 * i, 4096, 3))
        self.assertEqual(self.p.a.direct_writes, 1)

    def test_large_writes_and_unregistered_sources_go_through_kvproxy(self):
        self.p.write(0, direct.MAX_BYTES + 1, 5)
        self.assertTrue(self.p.landed(0, direct.MAX_BYTES + 1, 5))
        other = (ctypes.c_char * 64)()
        ctypes.memset(other, 6, 64)
        with self.assertRaisesRegex(control.KVProxyError, "not registered here"):
            self.p.a.write(self.p.peer, [ctypes.addressof(other)], [ctypes.addressof(self.p.dst)], [64])
        self.assertEqual(self.p.a.direct_writes, 0)
        self.assertEqual(self.p.kp[0].metric("kvproxy_memory_writes_total"), 2)

    def test_errors_are_the_old_paths(self):
        end = ctypes.addressof(self.p.dst) + SIZE
        src = ctypes.addressof(self.p.src)
        control._DIRECT = False
        try:
            with self.assertRaises(control.KVProxyError) as old:
                self.p.a.write(self.p.peer, [src], [end - 10], [64])
        finally:
            control._DIRECT = True
        with self.assertRaises(control.KVProxyError) as new:
            self.p.a.write(self.p.peer, [src], [end - 10], [64])
        self.assertEqual(str(new.exception), str(old.exception))
        self.assertIn("not registered at the peer", str(new.exception))
        # The connection carries on: the next write goes direct.
        self.p.write(0, 64, 9)
        self.assertTrue(self.p.landed(0, 64, 9))
        self.assertEqual(self.p.a.direct_writes, 1)

    def test_destination_registered_later_is_found(self):
        self.p.write(0, 64, 1)
        m = mmap.mmap(-1, 4096)
        late = (ctypes.c_char * 4096).from_buffer(m)
        self.p.b.register_host_memory(ctypes.addressof(late), 4096)
        ctypes.memset(ctypes.addressof(self.p.src), 4, 64)
        self.p.a.write(self.p.peer, [ctypes.addressof(self.p.src)], [ctypes.addressof(late)], [64])
        self.assertEqual(late[:64], b"\x04" * 64)
        self.assertEqual(self.p.a.direct_writes, 2)
        del late
        m.close()

    def test_peer_kvproxy_restarted(self):
        self.p.write(0, 64, 1)
        kb = self.p.kp[1]
        kb.kill()
        t0 = time.monotonic()
        with self.assertRaises(control.KVProxyError):
            self.p.write(0, 64, 2)
        self.assertLess(time.monotonic() - t0, 5, "a write to a dead peer must fail, not hang")
        kb.start()
        self.p.b.close()
        self.p.b = control.Client(kb.sock)
        self.p.b.register_host_memory(ctypes.addressof(self.p.dst), SIZE)
        time.sleep(control._DIRECT_RETRY)
        self.p.write(0, 64, 3)
        self.assertTrue(self.p.landed(0, 64, 3))
        self.assertEqual(self.p.a.direct_writes, 2, "writes go direct again once the peer is back")

    def test_silent_peer_fails_within_the_timeout(self):
        self.p.write(0, 64, 1)
        # A listener that takes the connection and never answers stands in
        # for a peer kvproxy that stopped.
        with socket.socket() as ln:
            ln.bind(("127.0.0.1", 0))
            ln.listen()
            silent = "127.0.0.1:%d" % ln.getsockname()[1]
            t0 = time.monotonic()
            with self.assertRaises(direct.Silent):
                direct.Peer(silent, 0.3)  # no answer to MEM_CLIENT
            self.assertLess(time.monotonic() - t0, 1.0)
            peer = self.p.a._routes[self.p.peer].peer
            peer.sock.close()
            peer.sock = socket.create_connection(ln.getsockname())
            t0 = time.monotonic()
            with self.assertRaises(TimeoutError):
                self.p.write(0, 64, 2, timeout=0.3)
            self.assertLess(time.monotonic() - t0, 1.0)
        self.assertIsNone(self.p.a._routes[self.p.peer].peer, "the silent connection is dropped")


    def test_peer_hanging_up_mid_write_falls_back(self):
        self.p.write(0, 64, 1)
        # The direct connection now goes to a stand-in that reads the write
        # and hangs up without answering: the write goes through kvproxy.
        with socket.socket() as ln:
            ln.bind(("127.0.0.1", 0))
            ln.listen()
            route = self.p.a._routes[self.p.peer]
            route.peer.sock.close()
            route.peer.sock = socket.create_connection(ln.getsockname())
            conn, _ = ln.accept()

            def hang_up():
                conn.recv(1 << 16)
                conn.close()

            t = threading.Thread(target=hang_up)
            t.start()
            self.p.write(0, 64, 2)
            t.join()
        self.assertTrue(self.p.landed(0, 64, 2))
        self.assertEqual((self.p.a.direct_writes, self.p.a.direct_fallbacks), (1, 1))
        self.p.write(0, 64, 3)  # a new direct connection
        self.assertTrue(self.p.landed(0, 64, 3))
        self.assertEqual(self.p.a.direct_writes, 2)

    def test_threads_writing_at_once(self):
        def writer(k):
            for i in range(50):
                off = 4096 * k + 64 * i
                base = ctypes.addressof(self.p.src) + off
                ctypes.memset(base, k + 1, 64)
                self.p.a.write(self.p.peer, [base], [ctypes.addressof(self.p.dst) + off], [64])

        ts = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        for k in range(4):
            self.assertTrue(self.p.landed(4096 * k, 64 * 50, k + 1))
        # One thread at a time holds the direct connection; the others' writes go through kvproxy.
        through = self.p.kp[0].metric("kvproxy_memory_writes_total")
        self.assertEqual(self.p.a.direct_writes + through, 200)
        self.assertGreater(self.p.a.direct_writes, 0)


class NotDirectTest(unittest.TestCase):
    def test_shm_writes_go_through_kvproxy(self):
        p = Pair("shm")
        self.addCleanup(p.close)
        p.write(0, 64, 7)
        self.assertTrue(p.landed(0, 64, 7))
        self.assertEqual(p.a.direct_writes, 0)
        self.assertIsNone(p.a._routes[p.peer].peer)
        self.assertIsNone(p.a._routes[p.peer].retry_at, "shm is no tcp for good: not asked again")

    def test_disabled(self):
        p = Pair("tcp")
        self.addCleanup(p.close)
        control._DIRECT = False
        self.addCleanup(setattr, control, "_DIRECT", True)
        p.write(0, 64, 7)
        self.assertTrue(p.landed(0, 64, 7))
        self.assertEqual(p.a.direct_writes, 0)


if __name__ == "__main__":
    unittest.main()
