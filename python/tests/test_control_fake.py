"""control.Client against a scripted kvproxy (a unix socket the test answers by hand)."""

import os
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import unittest

from pdrouter_kv import control


class FakeKVProxy:
    """Accepts one control connection; the test reads requests and writes replies."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="fake-kvproxy-")
        self.path = os.path.join(self.dir, "ctl.sock")
        self.ln = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.ln.bind(self.path)
        self.ln.listen(1)
        self.conn = None

    def accept(self):
        self.conn, _ = self.ln.accept()

    def _exactly(self, n):
        b = b""
        while len(b) < n:
            chunk = self.conn.recv(n - len(b))
            if not chunk:
                raise EOFError("client closed")
            b += chunk
        return b

    def request(self):
        """(op, id, body) of the next request."""
        n = struct.unpack("<I", self._exactly(4))[0]
        body = self._exactly(n)
        op, rid = struct.unpack_from("<BQ", body)
        return op, rid, body[9:]

    def reply(self, op, rid, err=b"", body=b""):
        payload = struct.pack("<BQI", op, rid, len(err)) + err + body
        self.conn.sendall(struct.pack("<I", len(payload)) + payload)

    def close(self):
        if self.conn is not None:
            self.conn.close()
        self.ln.close()
        os.unlink(self.path)
        os.rmdir(self.dir)


class _Clock:
    """A monotonic clock the test moves: control's deadlines without real waits."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self):
        return self.now


class _CountingLock:
    """The client's read lock, counting the callers that found it taken."""

    def __init__(self):
        self.lock = threading.Lock()
        self.refused = 0

    def acquire(self, blocking=True):
        got = self.lock.acquire(blocking)
        if not got:
            self.refused += 1
        return got

    def release(self):
        self.lock.release()

    def locked(self):
        return self.lock.locked()

    def __enter__(self):
        self.lock.acquire()

    def __exit__(self, *exc):
        self.lock.release()


def wait_until(cond, what):
    end = time.monotonic() + 10
    while not cond():
        if time.monotonic() > end:
            raise AssertionError("never: " + what)
        time.sleep(0.005)


class FakeServerTest(unittest.TestCase):
    def setUp(self):
        self.kp = FakeKVProxy()
        self.cl = control.Client(self.kp.path)
        self.kp.accept()

    def tearDown(self):
        self.cl.close()
        self.kp.close()

    def call_in_thread(self, timeout, out):
        def run():
            try:
                out["reply"] = self.cl._call(control.OP_PROBE, control._string("p"), timeout=timeout)
            except Exception as e:  # the test looks at what it was
                out["error"] = e

        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t

    def test_a_reader_that_times_out_lets_a_waiting_caller_read_its_reply(self):
        clock = _Clock()
        orig = control.time
        control.time = clock
        self.addCleanup(setattr, control, "time", orig)
        self.cl._read_lock = lock = _CountingLock()
        first, second = {}, {}
        t1 = self.call_in_thread(100, first)
        _, id1, _ = self.kp.request()
        wait_until(lock.locked, "the first caller reads the socket")
        t2 = self.call_in_thread(10000, second)
        _, id2, _ = self.kp.request()
        wait_until(lambda: lock.refused >= 1, "the second caller waits for the reader")
        # The first caller's deadline passes; a stray reply wakes it from poll.
        clock.now = 200
        self.kp.reply(control.OP_PROBE, 999)
        t1.join(10)
        self.assertIsInstance(first.get("error"), TimeoutError)
        # Now the second caller's reply comes: someone must read it.
        self.kp.reply(control.OP_PROBE, id2)
        t2.join(5)
        self.assertFalse(t2.is_alive(), "the second caller's reply sat unread in the socket")
        self.assertNotIn("error", second)

    def test_a_posted_request_nobody_waits_for_does_not_take_the_hand_over(self):
        # The nixl look-alike posts and reads replies later: the reader that
        # stops must wake a caller that waits, not the oldest request.
        clock = _Clock()
        orig = control.time
        control.time = clock
        self.addCleanup(setattr, control, "time", orig)
        self.cl._read_lock = lock = _CountingLock()
        posted = self.cl.post(control.OP_PROBE, control._string("p"))
        _, id0, _ = self.kp.request()
        first, second = {}, {}
        t1 = self.call_in_thread(100, first)
        self.kp.request()
        wait_until(lock.locked, "the first caller reads the socket")
        t2 = self.call_in_thread(10000, second)
        _, id2, _ = self.kp.request()
        wait_until(lambda: lock.refused >= 1, "the second caller waits for the reader")
        clock.now = 200
        self.kp.reply(control.OP_PROBE, 999)
        t1.join(10)
        self.assertIsInstance(first.get("error"), TimeoutError)
        self.kp.reply(control.OP_PROBE, id2)
        t2.join(5)
        self.assertFalse(t2.is_alive(), "the hand-over went to the posted request, and the caller's reply sat unread")
        self.assertNotIn("error", second)
        self.assertFalse(posted.done)
        self.kp.reply(control.OP_PROBE, id0)
        self.assertIsNotNone(self.cl.wait(posted, 5))

    def test_alive_from_many_threads_at_once(self):
        # The engine asks before each call while its watcher waits in alive()
        # for a hang-up: each thread polls with its own poll object.
        stop, seen = threading.Event(), []

        def watch():
            while not stop.is_set():
                try:
                    seen.append(self.cl.alive(0.001))
                except RuntimeError as e:  # "concurrent poll() invocation"
                    seen.append(e)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            self.assertTrue(all(self.cl.alive() for _ in range(2000)))
        finally:
            stop.set()
            watcher.join(5)
        self.assertTrue(seen and all(x is True for x in seen), seen[:3])
        self.kp.conn.close()
        wait_until(lambda: not self.cl.alive(), "alive() sees kvproxy hang up")

    def test_error_text_that_is_not_utf8_is_an_error_reply(self):
        out = {}
        t = self.call_in_thread(10, out)
        _, rid, _ = self.kp.request()
        self.kp.reply(control.OP_PROBE, rid, err=b"peer dropped data: \xff\xfe")
        t.join(5)
        self.assertIsInstance(out.get("error"), control.KVProxyError)
        # The connection goes on: the next reply is read.
        t = self.call_in_thread(10, out)
        _, rid, _ = self.kp.request()
        self.kp.reply(control.OP_PROBE, rid)
        t.join(5)
        self.assertIsNotNone(out.get("reply"))


# A kvproxy that takes in each request 5 ms after it came and answers 5 ms
# later, in a process of its own (no GIL between it and the caller).
_SLOW_KVPROXY = r"""
import select, socket, struct, sys, time
ln = socket.socket(socket.AF_UNIX)
ln.bind(sys.argv[1])
ln.listen(1)
print("ready", flush=True)
c, _ = ln.accept()
while select.select([c], [], [])[0]:
    time.sleep(0.005)
    head = c.recv(4, socket.MSG_WAITALL)
    if not head:
        break
    body = c.recv(struct.unpack("<I", head)[0], socket.MSG_WAITALL)
    time.sleep(0.005)
    reply = struct.pack("<BQI", body[0], struct.unpack_from("<Q", body, 1)[0], 0)
    c.sendall(struct.pack("<I", len(reply)) + reply)
"""


def _voluntary_switches():
    with open("/proc/thread-self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("voluntary_ctxt_switches"))


class WakeTest(unittest.TestCase):
    def test_a_waiting_caller_sleeps_through_kvproxy_taking_its_request(self):
        # kvproxy reading a request drains the caller's send buffer, which
        # wakes a caller blocked in recv(); one asleep in poll() wakes only
        # for the reply: one context switch a call, not two.
        d = tempfile.mkdtemp(prefix="slow-kvproxy-")
        path = os.path.join(d, "ctl.sock")
        srv = subprocess.Popen([sys.executable, "-c", _SLOW_KVPROXY, path], stdout=subprocess.PIPE)
        self.addCleanup(os.rmdir, d)
        self.addCleanup(os.unlink, path)
        self.addCleanup(srv.wait)
        self.addCleanup(srv.kill)
        self.assertEqual(srv.stdout.readline(), b"ready\n")
        cl = control.Client(path)
        self.addCleanup(cl.close)
        cl.probe("p")
        calls, before = 20, _voluntary_switches()
        for _ in range(calls):
            cl.probe("p")
        per_call = (_voluntary_switches() - before) / calls
        self.assertLessEqual(per_call, 1.5, "the caller woke %.2f times a call" % per_call)


class RegisterTimeoutTest(unittest.TestCase):
    """kvproxy may still carry out a register (or unregister) the client gave
    up waiting for: only dropping the connection, and with it everything
    registered on it, leaves the engine and kvproxy agreeing."""

    def setUp(self):
        self.kp = FakeKVProxy()
        self.addCleanup(self.kp.close)
        self.cl = control.Client(self.kp.path, timeout=0.3)
        self.addCleanup(self.cl.close)
        self.kp.accept()

    def dropped(self, op):
        got, _, _ = self.kp.request()
        self.assertEqual(got, op)
        self.kp.conn.settimeout(5)
        self.assertEqual(self.kp.conn.recv(1), b"", "the connection stayed open: kvproxy may keep what the engine thinks failed")
        self.assertFalse(self.cl.alive())

    def test_a_register_that_times_out_drops_the_connection(self):
        fd = os.open("/dev/null", os.O_RDONLY)
        self.addCleanup(os.close, fd)
        with self.assertRaises(control.ControlClosed):
            self.cl.register_memory(4096, 4096, fd)
        self.dropped(control.OP_REGISTER_MEMORY)

    def test_an_unregister_that_times_out_drops_the_connection(self):
        with self.assertRaises(control.ControlClosed):
            self.cl.unregister_memory(4096)
        self.dropped(control.OP_UNREGISTER_MEMORY)

    def test_a_probe_that_times_out_keeps_the_connection(self):
        with self.assertRaises(TimeoutError):
            self.cl.probe("p")
        self.assertTrue(self.cl.alive())


if __name__ == "__main__":
    unittest.main()
