"""A kvproxy that restarts serves the TransferEngine that kept running (issue 13 row 12)."""

import ctypes
import socket
import time
import unittest

from pdrouter_kv import control
from tests.kvproxy_proc import KVProxy
from tests.test_engine import buffer, engine_on

SIZE = 1 << 16


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(cond, timeout):
    """Seconds until cond() holds; fails the test after timeout."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError("not within %.1fs" % timeout)
        time.sleep(0.02)
    return time.monotonic() - t0


class RestartTest(unittest.TestCase):
    def setUp(self):
        # Fixed peer ports: peers name a kvproxy by it (SGLang's session id).
        self.a = KVProxy("prefill", extra=["--peer-port", str(free_port())])
        self.b = KVProxy("decode", extra=["--peer-port", str(free_port())])
        self.src_eng, self.dst_eng = engine_on(self.a), engine_on(self.b)
        self.src, self.dst = buffer(SIZE, 7), buffer(SIZE)
        self.assertEqual(self.src_eng.register_memory(ctypes.addressof(self.src), SIZE), 0)
        self.assertEqual(self.dst_eng.register_memory(ctypes.addressof(self.dst), SIZE), 0)

    def tearDown(self):
        self.src_eng.close()
        self.dst_eng.close()
        self.a.stop()
        self.b.stop()

    def write(self, fill=None):
        if fill is not None:
            ctypes.memset(self.src, fill, SIZE)
        return self.src_eng.transfer_sync_write(self.b.peer, ctypes.addressof(self.src), ctypes.addressof(self.dst), SIZE)

    def down_then_back(self, kp, fill):
        kp.kill()
        t0 = time.monotonic()
        self.assertEqual(self.write(fill), -1)
        self.assertLess(time.monotonic() - t0, 5, "a write while kvproxy is down must fail, not hang")
        kp.start()
        # The watcher registers the engine's memory again with no call from it.
        took = wait_for(lambda: kp.metric("kvproxy_registered_regions") == 1, 5)
        self.assertEqual(self.write(), 0)
        self.assertEqual(self.dst.raw, bytes([fill]) * SIZE)
        return took

    def test_restarted_source_kvproxy(self):
        self.assertEqual(self.write(), 0)
        took = self.down_then_back(self.a, 9)
        print("source kvproxy restarted: memory registered again after %.2fs" % took)

    def test_restarted_destination_kvproxy(self):
        # The decode engine makes no calls: only the watcher can notice.
        self.assertEqual(self.write(), 0)
        took = self.down_then_back(self.b, 11)
        print("destination kvproxy restarted: memory registered again after %.2fs" % took)

    def test_kvproxy_staying_down_fails_calls_fast_and_close_stops_the_watcher(self):
        self.a.kill()
        for _ in range(5):
            t0 = time.monotonic()
            self.assertEqual(self.write(), -1)
            self.assertLess(self.src_eng.send_probe(self.b.peer), 0)
            self.assertLess(time.monotonic() - t0, 0.5)
            time.sleep(0.3)  # across the redial interval: calls dial again, and fail again
        watcher = self.src_eng._watcher
        self.assertTrue(watcher.is_alive())
        self.src_eng.close()
        self.assertFalse(watcher.is_alive())
    def test_a_device_range_that_fails_to_register_again_does_not_stop_reconnecting(self):
        # Its allocation went (or the driver fails): the watcher must live on,
        # and the engine's other memory be served again.
        failed = []

        def failing(client, ptr, length):
            failed.append(ptr)
            raise ValueError("%#x is not CUDA device memory" % ptr)

        orig = control.Client.register_cuda_memory
        control.Client.register_cuda_memory = failing
        self.addCleanup(setattr, control.Client, "register_cuda_memory", orig)
        with self.src_eng._lock:
            self.src_eng._cuda[0x7F0000000000] = 4096
        self.assertEqual(self.write(), 0)
        self.a.kill()
        self.a.start()
        wait_for(lambda: failed, 5)
        wait_for(lambda: self.a.metric("kvproxy_registered_regions") == 1, 5)
        self.assertTrue(self.src_eng._watcher.is_alive(), "the watcher died on the failed re-register")
        self.assertEqual(self.write(5), 0)
        self.assertEqual(self.dst.raw, bytes([5]) * SIZE)


if __name__ == "__main__":
    unittest.main()
