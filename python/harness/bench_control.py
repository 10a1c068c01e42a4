"""Per-call cost of batch_transfer_sync_write: a 64-byte write (one range) and an
SGLang-sized call (16 ranges of 4 KiB), each a full round trip until the bytes
are in the peer's memory, through pdrouter's TransferEngine + kvproxy (tcp) and
through Mooncake's TransferEngine (TCP). Two engines in one process, page-
disjoint buffers. Prints one JSON line: {engine: {case: {p50_us, mean_us}}}.
"""

import argparse
import ctypes
import json
import mmap
import os
import subprocess
import sys
import tempfile
import time

import children

CALLS = 2000


def region(size):
    m = mmap.mmap(-1, size)
    return m, ctypes.addressof((ctypes.c_char * size).from_buffer(m))


def measure(src_eng, dst_eng):
    size = 1 << 20
    keep = []
    (ms, sp), (md, dp) = region(size), region(size)
    keep += [ms, md]
    assert src_eng.register_memory(sp, size) == 0
    assert dst_eng.register_memory(dp, size) == 0
    peer = "127.0.0.1:%d" % dst_eng.get_rpc_port()
    out = {}
    for case, n, ln in (("1x64B", 1, 64), ("16x4KiB", 16, 4096)):
        srcs = [sp + i * 8192 for i in range(n)]
        dsts = [dp + i * 8192 for i in range(n)]
        lens = [ln] * n
        for _ in range(100):
            assert src_eng.batch_transfer_sync_write(peer, srcs, dsts, lens) == 0
        ts = []
        for _ in range(CALLS):
            t = time.perf_counter()
            src_eng.batch_transfer_sync_write(peer, srcs, dsts, lens)
            ts.append(time.perf_counter() - t)
        ts.sort()
        out[case] = dict(p50_us=round(ts[len(ts) // 2] * 1e6, 1), mean_us=round(sum(ts) / len(ts) * 1e6, 1))
    return out


def child(kind):
    from mooncake.engine import TransferEngine
    engines = []
    for sock in os.environ.get("BENCH_SOCKS", ",").split(","):
        if sock:
            os.environ["PDROUTER_KVPROXY_SOCK"] = sock
        e = TransferEngine()
        assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        engines.append(e)
    print(json.dumps(measure(*engines)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--kvproxy")
    p.add_argument("--mooncake-path")
    p.add_argument("--child", default="")
    a = p.parse_args()
    if a.child:
        child(a.child)
        return
    children.exit_on_signals()
    res = {}
    env = dict(os.environ, MC_FORCE_TCP="1")
    r = subprocess.run([sys.executable, __file__, "--child", "mooncake"], env=dict(env, PYTHONPATH=a.mooncake_path),
                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, check=True)
    res["mooncake-tcp"] = json.loads(r.stdout.strip().splitlines()[-1])
    d = tempfile.mkdtemp(prefix="bench-control-")
    procs, socks = [], []
    try:
        for role in ("prefill", "decode"):
            sock = os.path.join(d, role + ".sock")
            argv = [a.kvproxy, "--role", role, "--transport", "tcp", "--control", sock, "--host", "127.0.0.1",
                    "--metrics-port", "0", "--log-level", "warn"] + (["--bootstrap-port", "0"] if role == "prefill" else [])
            pr = children.spawn(argv, stdout=subprocess.PIPE, text=True)
            procs.append(pr)
            assert pr.stdout.readline().startswith("kvproxy ready")
            socks.append(sock)
        r = subprocess.run([sys.executable, __file__, "--child", "kvproxy"], env=dict(env, BENCH_SOCKS=",".join(socks)),
                           stdout=subprocess.PIPE, text=True, check=True)
        res["kvproxy-tcp"] = json.loads(r.stdout.strip().splitlines()[-1])
    finally:
        for pr in procs:
            children.stop(pr)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
