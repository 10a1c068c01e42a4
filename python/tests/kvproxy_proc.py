"""Starts a real kvproxy for the tests ($KVPROXY, else built from the repo)."""

import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_built = None
_build_lock = threading.Lock()


def binary():
    global _built
    path = os.environ.get("KVPROXY")
    if path:
        return path
    with _build_lock:
        if _built is None:
            out = os.path.join(tempfile.mkdtemp(prefix="kvproxy-bin-"), "kvproxy")
            subprocess.run(["go", "build", "-o", out, "./cmd/kvproxy"], cwd=REPO, check=True)
            _built = out
    return _built


class KVProxy:
    def __init__(self, role="prefill", transport="tcp", extra=(), env=None):
        self.dir = tempfile.mkdtemp(prefix="kvproxy-test-")
        self.sock = os.path.join(self.dir, "ctl.sock")
        argv = [binary(), "--role", role, "--transport", transport, "--control", self.sock,
                "--host", "127.0.0.1", "--metrics-port", "0", "--log-level", "warn"]
        if role == "prefill":
            argv += ["--bootstrap-port", "0"]
        self.argv = argv + list(extra)
        self.env = dict(os.environ, **(env or {}))
        self.start()

    def start(self):
        self.log = open(os.path.join(self.dir, "log"), "a")
        self.p = subprocess.Popen(self.argv, env=self.env, stdout=subprocess.PIPE, stderr=self.log, text=True)
        line = self.p.stdout.readline()
        if not line.startswith("kvproxy ready"):
            self.p.kill()
            self.p.wait()
            self.log.close()
            raise RuntimeError("kvproxy did not start: %r; log: %s" % (line, open(os.path.join(self.dir, "log")).read()[-2000:]))
        self.fields = dict(kv.split("=", 1) for kv in line.split()[2:])
        self.peer = self.fields["peer"]

    def metric(self, name):
        text = urllib.request.urlopen("http://%s/metrics" % self.fields["metrics"], timeout=5).read().decode()
        total = 0.0
        for line in text.splitlines():
            m = re.match(r"^%s(\{[^}]*\})?\s+([0-9.e+-]+)$" % re.escape(name), line)
            if m:
                total += float(m.group(2))
        return total

    def wait_metric(self, name, want, timeout=5):
        end = time.time() + timeout
        got = self.metric(name)
        while got != want and time.time() < end:
            time.sleep(0.05)
            got = self.metric(name)
        return got

    def kill(self):
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait()
        self.p.stdout.close()
        self.log.close()

    def stop(self):
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self.p.stdout.close()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)
