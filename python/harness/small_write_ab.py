#!/usr/bin/env python3
"""A/B of one small write (batch_transfer_sync_write of 64 bytes, a full round
trip until the bytes are in the peer's memory) against Mooncake's TCP engine,
in one run: Mooncake and each side on each transport take turns, a batch of
calls each, the order reversed every round (the box is shared and its load
moves). A side is a kvproxy binary and the python/ tree its pdrouter_kv comes
from. Prints per engine the median over rounds of p50 and p99 (µs), the ratio
Mooncake / ours, CPU per write (µs) and context switches per write, over the
timed calls alone: every process of the pair, kvproxies included (and the
engine's process alone: engine_cpu_us, engine_switches).

  UCX_NET_DEVICES=lo nice -n 10 $VENV/bin/python python/harness/small_write_ab.py \\
      --rounds 5 --calls 1000 --mooncake-path $MOONCAKE old=/tmp/kvproxy-main:/tmp/main/python new=bin/kvproxy
"""

import argparse
import json
import os
import resource
import statistics
import sys
import time

import bench_control
import children

HERE = os.path.dirname(os.path.abspath(__file__))


def cpu_s(pid):
    """User + system CPU seconds of process pid, all its threads."""
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def self_cpu_s():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def switches(pid):
    """Context switches of process pid so far, all its threads."""
    n = 0
    for t in os.listdir("/proc/%d/task" % pid):
        try:
            with open("/proc/%d/task/%s/status" % (pid, t)) as f:
                n += sum(int(l.split()[1]) for l in f if "ctxt_switches" in l)
        except FileNotFoundError:  # the thread ended
            pass
    return n


def self_switches():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_nvcsw + r.ru_nivcsw


def child(calls):
    src_eng, dst_eng = bench_control.engines()
    size = 1 << 20
    (ms, sp), (md, dp) = bench_control.region(size), bench_control.region(size)
    assert src_eng.register_memory(sp, size) == 0
    assert dst_eng.register_memory(dp, size) == 0
    peer = "127.0.0.1:%d" % dst_eng.get_rpc_port()
    pids = [int(p) for p in os.environ.get("BENCH_PIDS", "").split(",") if p]
    for _ in range(200):
        assert src_eng.batch_transfer_sync_write(peer, [sp], [dp], [64]) == 0
    ts = []
    cpu0 = [self_cpu_s()] + [cpu_s(p) for p in pids]
    sw0 = [self_switches()] + [switches(p) for p in pids]
    failed = 0
    for _ in range(calls):
        t = time.perf_counter()
        failed += src_eng.batch_transfer_sync_write(peer, [sp], [dp], [64]) != 0
        ts.append(time.perf_counter() - t)
    cpu = [(b - a) / calls * 1e6 for a, b in zip(cpu0, [self_cpu_s()] + [cpu_s(p) for p in pids])]
    sw = [(b - a) / calls for a, b in zip(sw0, [self_switches()] + [switches(p) for p in pids])]
    if failed:
        sys.exit("%d of %d writes failed" % (failed, calls))
    ts.sort()
    print(json.dumps(dict(p50_us=ts[len(ts) // 2] * 1e6, p99_us=ts[len(ts) * 99 // 100] * 1e6,
                          cpu_us=sum(cpu), engine_cpu_us=cpu[0], switches=sum(sw), engine_switches=sw[0])))
    del ms, md


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=1000)
    p.add_argument("--transports", default="tcp,ucx,shm")
    p.add_argument("--mooncake-path", default=os.environ.get("MOONCAKE", ""))
    p.add_argument("--child", action="store_true")
    p.add_argument("sides", nargs="*", help="label=kvproxy[:python dir] (default python dir: this tree's)")
    a = p.parse_args()
    if a.child:
        child(a.calls)
        return
    children.exit_on_signals()
    runs = {"mooncake-tcp": lambda: bench_control.run_child(dict(os.environ, MC_FORCE_TCP="1", PYTHONPATH=a.mooncake_path), a.calls, __file__)}
    for side in a.sides:
        label, _, spec = side.partition("=")
        kvproxy, _, py = spec.partition(":")
        for t in a.transports.split(","):
            runs["%s-%s" % (label, t)] = lambda k=kvproxy, py=py or os.path.dirname(HERE), t=t: bench_control.kvproxy_round(k, t, a.calls, py, __file__)
    rounds = {name: [] for name in runs}
    names = list(runs)
    for i in range(a.rounds):
        for name in names if i % 2 == 0 else names[::-1]:
            rounds[name].append(runs[name]())
    out = {}
    for name, rs in rounds.items():
        out[name] = {k: round(statistics.median(r[k] for r in rs), 1) for k in ("p50_us", "p99_us", "cpu_us", "engine_cpu_us")}
        out[name].update((k, round(statistics.median(r[k] for r in rs), 2)) for k in ("switches", "engine_switches"))
    base = out["mooncake-tcp"]
    for name, r in out.items():
        if name != "mooncake-tcp":
            r["vs_mooncake_p50"] = round(base["p50_us"] / r["p50_us"], 2)
            r["vs_mooncake_p99"] = round(base["p99_us"] / r["p99_us"], 2)
    for name, r in out.items():
        print("%-16s %s" % (name, json.dumps(r)))


if __name__ == "__main__":
    main()
