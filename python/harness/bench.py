"""make bench-kv-sglang: SGLang 0.5.23's mooncake backend moving Llama-3.1-8B-shaped
KV (32 layers x K,V x 8 KV heads x 128 dim bf16) through Mooncake's TransferEngine
(TCP) and through kvproxy (tcp, UCX over tcp, UCX over shared memory, kvproxy's shm),
and SGLang's nixl backend through NIXL 1.5 from PyPI (UCX 1.23 inside it) and
through python/nixl over kvproxy, plus a memcpy over the same working set and the
per-call cost of a tiny write, all in one run. Writes bench/out/kv-sglang.json
and prints a Markdown table.
"""

import ctypes
import glob

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import children

HERE = os.path.dirname(os.path.abspath(__file__))
# 32 layers x (K, V) x 8 KV heads x 128 dims x 2 bytes (bf16); the harness checks
# it against SGLang's own kv_item_lens.
BYTES_PER_TOKEN = 32 * 2 * 8 * 128 * 2

CONFIGS = [
    ("mooncake-tcp", ["--engine", "mooncake"]),
    ("kvproxy-tcp", ["--engine", "kvproxy", "--transport", "tcp"]),
    ("kvproxy-ucx-tcp", ["--engine", "kvproxy", "--transport", "ucx", "--ucx-tls", "tcp"]),
    ("kvproxy-ucx-shm", ["--engine", "kvproxy", "--transport", "ucx", "--ucx-tls", "posix,cma,tcp"]),
    # kvproxy's own same-host path: the writer maps the peer engine's memfd and copies.
    ("kvproxy-shm", ["--engine", "kvproxy", "--transport", "shm"]),
    # SGLang's nixl backend. NIXL's best same-host path is its default UCX_TLS
    # (puts by cma, zero-copy; its notifications need tcp: UCX_TLS=sm fails).
    ("nixl-ucx", ["--engine", "nixl-real"]),
    ("nixl-ucx-tcp", ["--engine", "nixl-real", "--ucx-tls", "tcp"]),
    ("kvproxy-nixl-ucx-tcp", ["--engine", "nixl", "--transport", "ucx", "--ucx-tls", "tcp"]),
    ("kvproxy-nixl-shm", ["--engine", "nixl", "--transport", "shm"]),
]
# What each nixl row is compared with: the same UCX_TLS, or NIXL's best.
NIXL_BASE = {"nixl-ucx-tcp": "nixl-ucx-tcp", "kvproxy-nixl-ucx-tcp": "nixl-ucx-tcp", "kvproxy-nixl-shm": "nixl-ucx"}


def ucx_versions(nixl_path):
    """UCX's version as kvproxy loads it (the system's libucp) and as NIXL's wheel bundles it."""
    out = {}
    for name, pattern in (("kvproxy", "libucp.so.0"), ("nixl", os.path.join(nixl_path, "nixl_cu*.libs", "libucp-*.so*"))):
        paths = glob.glob(pattern) if os.sep in pattern else [pattern]
        try:
            f = ctypes.CDLL(paths[0]).ucp_get_version_string
            f.restype = ctypes.c_char_p
            out[name] = f().decode()
        except (OSError, IndexError, AttributeError) as e:
            out[name] = "unknown (%s)" % e
    return out


def memcpy_gbps(nbytes, repeat=3):
    """Best-of-repeat torch copy of nbytes between two fresh CPU tensors (one thread
    of the copy touches the same amount of memory one transfer does)."""
    import torch
    src = torch.ones(nbytes // 2, dtype=torch.int16)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    del src, dst
    return nbytes / best / 1e9


def summarize(per_request, bytes_per_token, prefill_tps):
    out = {}
    for tokens in sorted({x["tokens"] for x in per_request}):
        rs = [x for x in per_request if x["tokens"] == tokens]
        # Each size's first request is not counted: it pays what the size changes.
        if len(rs) > 2:
            rs = rs[1:]
        nbytes = tokens * bytes_per_token
        transfer = statistics.median(x["transfer_s"] for x in rs)
        engine = statistics.median(x["engine_s"] for x in rs)
        calls = statistics.median(x["engine_calls"] for x in rs)
        make = statistics.median(x["engine_make_s"] for x in rs)
        wall = statistics.median(x["decode_wall_s"] for x in rs)
        compute = tokens / prefill_tps
        out[str(tokens)] = dict(
            requests=len(rs), bytes=nbytes, transfer_s=transfer, engine_s=engine, engine_calls=calls, engine_make_s=make,
            gbps_engine=nbytes / engine / 1e9 if engine else None, gbps_transfer=nbytes / transfer / 1e9,
            decode_wall_s=wall, ttft_model_s=compute + wall, kv_share_of_ttft=transfer / (compute + wall),
        )
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--kvproxy", required=True)
    p.add_argument("--mooncake-path", required=True)
    p.add_argument("--nixl-path", required=True)
    p.add_argument("--sizes", default="128x6,1024x6,4096x5,32768x3")
    p.add_argument("--prefill-tps", type=float, default=20000,
                   help="modelled prefill compute, tokens/s (the harness has no model; TTFT = this + the measured PD hand-off)")
    p.add_argument("--configs", default=",".join(c for c, _ in CONFIGS))
    p.add_argument("--out", default="bench/out/kv-sglang.json")
    p.add_argument("--workdir", default="/tmp/pdrouter-bench-kv-sglang")
    a = p.parse_args()
    children.exit_on_signals()  # subprocess.run then kills the running harness, whose children follow it

    res = dict(layout=dict(model="Llama-3.1-8B", layers=32, kv_heads=8, head_dim=128, dtype="bfloat16", page_size=16),
               sizes=a.sizes, prefill_tps_model=a.prefill_tps, started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               ucx_versions=ucx_versions(a.nixl_path), ucx_net_devices=os.environ.get("UCX_NET_DEVICES", ""), configs={})
    wanted = a.configs.split(",")
    sizes = [int(part.split("x")[0]) for part in a.sizes.split(",")]
    for name, args in CONFIGS:
        if name not in wanted:
            continue
        sj = os.path.join(a.workdir, name + ".json")
        argv = [a.python, os.path.join(HERE, "run_pd.py"), "--python", a.python, "--label", name,
                "--kvproxy", a.kvproxy, "--mooncake-path", a.mooncake_path, "--nixl-path", a.nixl_path,
                "--phases", "warmup,normal", "--abort", "0",
                "--sizes", a.sizes, "--concurrency", "1", "--layers", "32", "--kv-heads", "8", "--head-dim", "128",
                "--chunk-tokens", "8192", "--fill", "sample", "--bound", "120",
                # One 8192-token chunk is 1 GiB here: give a slow transport time for it.
                "--kvproxy-arg=--write-timeout=60s",
                "--workdir", os.path.join(a.workdir, name), "--out", sj] + args
        print("bench-kv-sglang: %s ..." % name, file=sys.stderr, flush=True)
        # memcpy next to each config: the box is shared and its load moves.
        copy = {str(t): memcpy_gbps(t * BYTES_PER_TOKEN) for t in sizes}
        load = os.getloadavg()[0]
        subprocess.run(argv, stdout=subprocess.PIPE, text=True)
        with open(sj) as f:
            s = json.load(f)
        if not s["ok"]:
            print("bench-kv-sglang: %s failed: %s" % (name, s["failures"]), file=sys.stderr)
            res["configs"][name] = dict(ok=False, failures=s["failures"])
            continue
        if s["bytes_per_token"] != BYTES_PER_TOKEN:
            raise SystemExit("SGLang lays out %d bytes per token, expected %d" % (s["bytes_per_token"], BYTES_PER_TOKEN))
        res["bytes_per_token"] = s["bytes_per_token"]
        # The 1-minute load average around the run: this 2-core box is shared.
        tls = next((v for k, v in zip(args, args[1:]) if k == "--ucx-tls"), "")
        res["configs"][name] = dict(ok=True, load_avg=[round(load, 1), round(os.getloadavg()[0], 1)], memcpy_gbps=copy,
                                    backend=s["backend"], transport=s["transport"],
                                    ucx_tls=tls or ("default" if s["transport"] in ("ucx", "nixl-ucx") else "-"),
                                    sizes=summarize(s["per_request"], s["bytes_per_token"], a.prefill_tps))
    # Control cost of one call: a tiny write's round trip through each engine.
    r = subprocess.run([a.python, os.path.join(HERE, "bench_control.py"), "--kvproxy", a.kvproxy,
                        "--mooncake-path", a.mooncake_path], stdout=subprocess.PIPE, text=True, check=True)
    res["call_cost"] = json.loads(r.stdout.strip().splitlines()[-1])
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(table(res))


def table(res):
    configs = res["configs"]
    base = configs.get("mooncake-tcp", {}).get("sizes", {})
    lines = ["UCX: kvproxy %s, NIXL %s; UCX_NET_DEVICES=%s" % (
                 res["ucx_versions"].get("kvproxy"), res["ucx_versions"].get("nixl"), res.get("ucx_net_devices") or "(unset)"), "",
             "| engine | UCX_TLS | tokens | MiB | transfer ms | GB/s | vs Mooncake | vs NIXL | post µs (make + transfer) | memcpy GB/s | of memcpy | KV share of TTFT |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, c in configs.items():
        if not c.get("ok"):
            lines.append("| %s | failed: %s |" % (name, "; ".join(c["failures"])[:200]))
            continue
        label = "%s (load %s)" % (name, "→".join(str(v) for v in c.get("load_avg", [])))
        nixl = configs.get(NIXL_BASE.get(name), {}).get("sizes", {})
        for tokens, x in c["sizes"].items():
            b = None if c.get("backend") == "nixl" else base.get(tokens)
            n = nixl.get(tokens) if name != NIXL_BASE.get(name) else None
            mc = c["memcpy_gbps"].get(tokens)
            ratio = "%.2fx" % (x["gbps_transfer"] / b["gbps_transfer"]) if b else "-"
            vs_nixl = "**%.2fx**" % (x["gbps_transfer"] / n["gbps_transfer"]) if n else "-"
            # nixl rows: SGLang's calls per request until posted: making the
            # requests (make_prepped_xfer, initialize_xfer) + transfer().
            post = "%.0f + %.0f" % (x["engine_make_s"] * 1e6, (x["engine_s"] - x["engine_make_s"]) * 1e6) if c.get("backend") == "nixl" else "-"
            lines.append("| %s | %s | %s | %.1f | %.1f | %.2f | %s | %s | %s | %.2f | %.0f %% | %.0f %% |" % (
                label, c.get("ucx_tls", "-"), tokens, x["bytes"] / 2**20, x["transfer_s"] * 1e3, x["gbps_transfer"], ratio,
                vs_nixl, post, mc or 0, 100 * x["gbps_transfer"] / mc if mc else 0, 100 * x["kv_share_of_ttft"]))
    cc = res.get("call_cost", {})
    if cc:
        cases = list(next(iter(cc.values())))
        lines += ["", "Per call (batch_transfer_sync_write until the bytes are in the peer's memory; median of the rounds' p50):", "",
                  "| engine | " + " | ".join("%s µs | vs Mooncake" % c for c in cases) + " |",
                  "|---|" + "---:|---:|" * len(cases)]
        for name, v in cc.items():
            lines.append("| %s | %s |" % (name, " | ".join("%.1f | %s" % (v[c]["p50_us"], "%.2fx" % v[c]["vs_mooncake"] if "vs_mooncake" in v[c] else "-")
                                                         for c in cases)))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
