#!/usr/bin/env python3
"""A/B of the mock engine's rooms at one prompt size, in one run.

Each side is a directory holding kvproxy and mockworker, and a transport
(with UCX_TLS for ucx): one prefill and one decode mockworker with their
kvproxies, the default Llama-3.1-8B layout (128 KiB of KV a token), PD
requests straight to the engines (no router), max_new_tokens=1. The sides
take turns, one request each per round, so load on the box falls on both;
the first round warms up. Reports per side the best and median of the
sender's transfer time (kv_transfer.transfer_ms) and of TTFT (the decode
request's time: prefill filling the pages, the transfer, decode verifying).

  python3 python/harness/rooms_ab.py --tokens 4096 --rounds 8 \\
      old=/tmp/old-bin:ucx:posix,cma,tcp new=bin:shm
"""
import argparse
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import tempfile
import threading
import time
import urllib.request

import children


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Side:
    def __init__(self, label, bindir, transport, tls, pool_tokens):
        self.label, self.dir = label, tempfile.mkdtemp(prefix="kv-ab-")
        env = dict(os.environ)
        if tls:
            env.update(UCX_TLS=tls, UCX_NET_DEVICES="lo")
        self.procs = []
        self.boot = free_port()
        for role in ("prefill", "decode"):
            sock = os.path.join(self.dir, role + ".sock")
            argv = [os.path.join(bindir, "kvproxy"), "--role", role, "--transport", transport, "--control", sock,
                    "--metrics-port", "0", "--log-level", "warn"]
            if role == "prefill":
                argv += ["--bootstrap-port", str(self.boot)]
            self.start(argv, env, "kvproxy ready")
            port = free_port()
            self.start([os.path.join(bindir, "mockworker"), "--role", role, "--port", str(port), "--kvproxy", sock,
                        "--kv-pool-tokens", str(pool_tokens)], env, "listening on")
            setattr(self, role, "http://127.0.0.1:%d/generate" % port)

    def start(self, argv, env, ready):
        log = open(os.path.join(self.dir, "%d.log" % len(self.procs)), "w")
        p = children.spawn(argv, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
        self.procs.append(p)
        deadline = time.time() + 120
        while time.time() < deadline:
            line = p.stdout.readline()
            if not line:
                raise RuntimeError("%s: %s exited" % (self.label, argv[0]))
            if ready in line:
                threading.Thread(target=p.stdout.read, daemon=True).start()
                return
        raise RuntimeError("%s: %s not ready" % (self.label, argv[0]))

    def once(self, tokens, room):
        ids = ",".join(str(random.randrange(32000)) for _ in range(tokens))
        body = ('{"input_ids":[%s],"sampling_params":{"max_new_tokens":1},"bootstrap_host":"127.0.0.1",'
                '"bootstrap_port":%d,"bootstrap_room":%d}' % (ids, self.boot, room)).encode()
        out = {}

        def post(url, key):
            req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
            out[key] = urllib.request.urlopen(req, timeout=300).read()

        t = threading.Thread(target=post, args=(self.prefill, "p"))
        t.start()
        t0 = time.perf_counter()
        post(self.decode, "d")
        ttft = (time.perf_counter() - t0) * 1000
        t.join()
        kv = json.loads(out["d"])["meta_info"]["kv_transfer"]
        if not kv["checksum_ok"]:
            raise RuntimeError("%s: checksum mismatch" % self.label)
        return kv["transfer_ms"], ttft, kv["transport"], kv["bytes"]

    def stop(self):
        for p in self.procs:
            children.stop(p)
        shutil.rmtree(self.dir, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("sides", nargs="+", help="label=bindir:transport[:UCX_TLS]")
    a = ap.parse_args()
    children.exit_on_signals()
    sides = []
    try:
        for spec in a.sides:
            label, rest = spec.split("=", 1)
            parts = rest.split(":", 2)
            sides.append(Side(label, parts[0], parts[1], parts[2] if len(parts) > 2 else "", 2 * a.tokens))
        res = {s.label: [] for s in sides}
        for r in range(a.rounds + 1):
            for i, s in enumerate(sides):
                got = s.once(a.tokens, 1000 * r + i + 1)
                if r > 0:
                    res[s.label].append(got)
        for s in sides:
            xs = res[s.label]
            tr, tt = [x[0] for x in xs], [x[1] for x in xs]
            print("%-6s %-4s %d tokens, %d MiB: transfer best %.2f ms median %.2f ms; TTFT best %.1f ms median %.1f ms"
                  % (s.label, xs[0][2], a.tokens, xs[0][3] >> 20, min(tr), statistics.median(tr), min(tt), statistics.median(tt)))
    finally:
        for s in sides:
            s.stop()
        children.stop_all()  # a side's that failed to start


if __name__ == "__main__":
    main()
