"""The harness's kvproxies and engines end with it (children.py): run_pd.py
ended by SIGTERM stops them before it exits, and one ended by SIGKILL takes
them along through the parent-death signal. Before, both left them running.

Run from python/harness: python3 -m unittest test_children
"""

import os
import signal
import stat
import subprocess
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))

# A kvproxy as run_pd.py sees one: the ready line, and metrics saying it
# holds no regions.
FAKE_KVPROXY = """#!%s
import http.server, os, threading
with open(os.environ["REAP_PIDS"], "a") as f:
    f.write("%%d\\n" %% os.getpid())
class Metrics(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"kvproxy_registered_regions 0\\n")
    def log_message(self, *a):
        pass
srv = http.server.HTTPServer(("127.0.0.1", 0), Metrics)
threading.Thread(target=srv.serve_forever, daemon=True).start()
print("kvproxy ready role=x metrics=127.0.0.1:%%d" %% srv.server_port, flush=True)
threading.Event().wait()
""" % sys.executable

# An engine that never gets ready: run_pd.py waits for it.
FAKE_ENGINE = """#!/bin/sh
echo $$ >> "$REAP_PIDS"
exec sleep 600
"""


def gone(pid):
    """pid has exited (a zombie nobody reaped counts as gone)."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_until(cond, timeout):
    end = time.time() + timeout
    while time.time() < end:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


class HarnessReapsItsChildren(unittest.TestCase):
    def start_harness(self):
        d = tempfile.mkdtemp(prefix="reap-")
        self.pids = os.path.join(d, "pids")
        open(self.pids, "w").close()
        tools = {}
        for name, text in (("kvproxy", FAKE_KVPROXY), ("python", FAKE_ENGINE)):
            tools[name] = os.path.join(d, name)
            with open(tools[name], "w") as f:
                f.write(text)
            os.chmod(tools[name], stat.S_IRWXU)
        harness = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "run_pd.py"), "--engine", "kvproxy", "--kvproxy", tools["kvproxy"],
             "--python", tools["python"], "--workdir", os.path.join(d, "work"), "--requests", "1"],
            env=dict(os.environ, REAP_PIDS=self.pids), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.addCleanup(lambda: harness.poll() is None and harness.kill())
        self.assertTrue(wait_until(lambda: len(self.children()) == 4, 30),
                        "the harness started %d of its 2 kvproxies and 2 engines" % len(self.children()))
        self.addCleanup(self.kill_left)
        return harness

    def children(self):
        with open(self.pids) as f:
            return [int(x) for x in f.read().split()]

    def kill_left(self):
        for pid in self.children():
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)

    def test_sigterm_stops_children(self):
        harness = self.start_harness()
        harness.send_signal(signal.SIGTERM)
        self.assertEqual(harness.wait(30), 128 + signal.SIGTERM)
        left = [pid for pid in self.children() if not gone(pid)]
        self.assertEqual(left, [], "children still running after the harness exited")

    def test_sigkill_takes_children_along(self):
        harness = self.start_harness()
        harness.kill()
        harness.wait(30)
        self.assertTrue(wait_until(lambda: all(gone(pid) for pid in self.children()), 10),
                        "children %s still running 10 s after the harness was killed" %
                        [pid for pid in self.children() if not gone(pid)])


if __name__ == "__main__":
    unittest.main()
