"""Per-call cost of batch_transfer_sync_write: a 64-byte write (one range) and an
SGLang-sized call (16 ranges of 4 KiB), each a full round trip until the bytes
are in the peer's memory, through Mooncake's TransferEngine (TCP) and through
pdrouter's TransferEngine + a pair of kvproxies on each transport (tcp, shm,
ucx). Two engines in one process, page-disjoint buffers. The engines take turns
round by round (the box is shared and its load moves); each figure is the
median over the rounds of one round's p50. Prints one JSON line:
{engine: {case: {p50_us, mean_us, rounds_p50_us[, vs_mooncake]}}}; vs_mooncake
is Mooncake's p50 over ours (above 1: ours is faster).
"""

import argparse
import ctypes
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time

import children

HERE = os.path.dirname(os.path.abspath(__file__))
# The tree's pdrouter_kv, not whatever copy the venv holds.
PYTHON_DIR = os.path.dirname(HERE)
CASES = (("1x64B", 1, 64), ("16x4KiB", 16, 4096))
TRANSPORTS = ("tcp", "shm", "ucx")


def region(size):
    m = mmap.mmap(-1, size)
    return m, ctypes.addressof((ctypes.c_char * size).from_buffer(m))


def measure(src_eng, dst_eng, calls):
    size = 1 << 20
    keep = []
    (ms, sp), (md, dp) = region(size), region(size)
    keep += [ms, md]
    assert src_eng.register_memory(sp, size) == 0
    assert dst_eng.register_memory(dp, size) == 0
    peer = "127.0.0.1:%d" % dst_eng.get_rpc_port()
    out = {}
    for case, n, ln in CASES:
        srcs = [sp + i * 8192 for i in range(n)]
        dsts = [dp + i * 8192 for i in range(n)]
        lens = [ln] * n
        for _ in range(100):
            assert src_eng.batch_transfer_sync_write(peer, srcs, dsts, lens) == 0
        ts = []
        for _ in range(calls):
            t = time.perf_counter()
            src_eng.batch_transfer_sync_write(peer, srcs, dsts, lens)
            ts.append(time.perf_counter() - t)
        ts.sort()
        out[case] = dict(p50_us=round(ts[len(ts) // 2] * 1e6, 1), mean_us=round(sum(ts) / len(ts) * 1e6, 1))
    return out


def engines():
    """The source and destination TransferEngines, each on its kvproxy of
    BENCH_SOCKS (unset: Mooncake's own engine)."""
    from mooncake.engine import TransferEngine
    out = []
    for sock in os.environ.get("BENCH_SOCKS", ",").split(","):
        if sock:
            os.environ["PDROUTER_KVPROXY_SOCK"] = sock
        e = TransferEngine()
        assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        out.append(e)
    return out


def child(calls):
    print(json.dumps(measure(*engines(), calls)))


def run_child(env, calls, script=__file__):
    """Runs script's --child in a fresh interpreter (env picks its engine module)."""
    r = subprocess.run([sys.executable, script, "--child", "--calls", str(calls)], env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def mooncake_round(mooncake_path, calls):
    return run_child(dict(os.environ, MC_FORCE_TCP="1", PYTHONPATH=mooncake_path), calls)


def kvproxy_round(kvproxy, transport, calls, pythonpath, script=__file__):
    """A prefill and a decode kvproxy, and script's child writing between them
    (BENCH_PIDS: the kvproxies, for a child that reads their CPU)."""
    d = tempfile.mkdtemp(prefix="bench-control-")
    procs, socks = [], []
    try:
        for role in ("prefill", "decode"):
            sock = os.path.join(d, role + ".sock")
            argv = [kvproxy, "--role", role, "--transport", transport, "--control", sock, "--host", "127.0.0.1",
                    "--metrics-port", "0", "--log-level", "warn"] + (["--bootstrap-port", "0"] if role == "prefill" else [])
            pr = children.spawn(argv, stdout=subprocess.PIPE, text=True)
            procs.append(pr)
            assert pr.stdout.readline().startswith("kvproxy ready")
            socks.append(sock)
        env = dict(os.environ, BENCH_SOCKS=",".join(socks), BENCH_PIDS=",".join(str(p.pid) for p in procs),
                   PYTHONPATH=pythonpath)
        return run_child(env, calls, script)
    finally:
        for pr in procs:
            children.stop(pr)
        for s in socks:
            if os.path.exists(s):
                os.unlink(s)
        os.rmdir(d)


def summarize(rounds):
    out = {}
    for case, _, _ in CASES:
        p50s = [r[case]["p50_us"] for r in rounds]
        out[case] = dict(p50_us=round(statistics.median(p50s), 1),
                         mean_us=round(statistics.median(r[case]["mean_us"] for r in rounds), 1), rounds_p50_us=p50s)
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--kvproxy")
    p.add_argument("--mooncake-path")
    p.add_argument("--transports", default=",".join(TRANSPORTS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--pythonpath", default=PYTHON_DIR, help="where pdrouter_kv comes from (default: this tree's)")
    p.add_argument("--child", action="store_true")
    a = p.parse_args()
    if a.child:
        child(a.calls)
        return
    children.exit_on_signals()
    engines = {"mooncake-tcp": lambda: mooncake_round(a.mooncake_path, a.calls)}
    for t in a.transports.split(","):
        engines["kvproxy-" + t] = lambda t=t: kvproxy_round(a.kvproxy, t, a.calls, a.pythonpath)
    rounds = {name: [] for name in engines}
    for _ in range(a.rounds):
        for name, run in engines.items():
            rounds[name].append(run())
    res = {name: summarize(rs) for name, rs in rounds.items()}
    base = res["mooncake-tcp"]
    for name, r in res.items():
        if name != "mooncake-tcp":
            for case, x in r.items():
                x["vs_mooncake"] = round(base[case]["p50_us"] / x["p50_us"], 2)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
