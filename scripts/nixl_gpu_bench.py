"""GPU KV through the NIXL API, NIXL itself against python/nixl over kvproxy
(issue 25, run on the GPU machine by scripts/bench-nixl-gpu.sh).

The same calls as SGLang 0.5.23's nixl backend, made in the same order by
one script for both implementations: two engine processes on one GPU (this
one writes, a child receives) hold the Llama-3.1-8B layout of
kv_gpu_bench.py (64 buffers, 32 KiB pages), register it as VRAM, and the
writer posts each transfer as SGLang does: Nx5 strided prepared lists (one
run per buffer, a slot per page), make_prepped_xfer("WRITE", ...) with one
index per buffer and page, transfer(), then check_xfer_state() until DONE.
Every received page is checksummed on the GPU against the sender's, and the
pages between them must be untouched.

    --impl nixl:    PyPI's NIXL (nixl_cu13 from --nixl-path, UCX 1.23 inside)
    --impl kvproxy: python/nixl, the look-alike, over two kvproxies
    --summary DIR:  pools the rounds' JSON files in DIR (nixl-gpu-IMPL-ROUND.json,
                    as scripts/bench-nixl-gpu.sh writes them) into nixl-gpu.json
                    and prints kvproxy against NIXL (runs without a GPU)

Both are timed alike: after --warmup posts, each of --reps posts is timed
from make_prepped_xfer to check_xfer_state's DONE (total), split at
transfer()'s return (post: until the transfer is on its way; complete: the
rest). One run is one round; bench-nixl-gpu.sh alternates the two
libraries' rounds so that drift over the call hits both alike.
"""
import argparse
import importlib
import json
import os
import statistics
import sys
import tempfile
import time

here = os.path.dirname(os.path.abspath(__file__))
np = torch = kv = None  # load_gpu(): --summary runs without them


def load_gpu():
    global np, torch, kv
    import numpy
    import torch as t
    sys.path.insert(0, here)
    import kv_gpu_bench as k
    np, torch, kv = numpy, t, k


def load_api(impl, nixl_path):
    if impl == "nixl":
        sys.path.insert(0, nixl_path)
        os.environ.setdefault("NIXL_PLUGIN_DIR", os.path.join(nixl_path, ".nixl_cu13.mesonpy.libs", "plugins"))
        return importlib.import_module("nixl_cu13._api")
    sys.path.insert(0, os.path.join(here, "..", "python"))
    return importlib.import_module("nixl._api")


def agent(api, name):
    a = api.nixl_agent(name, api.nixl_agent_config(backends=[]))
    a.create_backend("UCX", {})
    return a


def strided(ptrs, dev):
    """SGLang 0.5.23's prepared list: (base, page, device, stride, slots) per buffer."""
    return np.array([(p, kv.PAGE_BYTES, dev, kv.PAGE_BYTES, kv.POOL_PAGES) for p in ptrs], dtype=np.uint64)


def register(a, bufs):
    dev = torch.cuda.current_device()
    if not a.register_memory([(b.data_ptr(), b.numel() * b.element_size(), dev, "") for b in bufs], "VRAM"):
        raise RuntimeError("register_memory failed")


def receiver(args):
    # Replies go on the original stdout; whatever NIXL and UCX print (their
    # loggers write to sys.stdout) goes to stderr.
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    def reply(obj):
        replies.write(json.dumps(obj) + "\n")
        replies.flush()

    api = load_api(args.impl, args.nixl_path)
    torch.cuda.init()
    bufs = kv.pool()
    a = agent(api, "decode")
    register(a, bufs)
    meta = os.path.join(args.workdir, "decode.meta")
    with open(meta, "wb") as f:
        f.write(a.get_agent_metadata())
    # SGLang sends these in its registration message over ZMQ.
    reply({"meta": meta, "ptrs": [b.data_ptr() for b in bufs], "dev": torch.cuda.current_device()})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "fill":
            for b in bufs:
                b.view(torch.int16).fill_(kv.FILL)
            torch.cuda.synchronize()
            reply({})
        elif cmd["op"] == "verify":
            reply(kv.verify(bufs, cmd))
        elif cmd["op"] == "quit":
            break
    del a


def indices(pages):
    """make_prepped_xfer's indices: buffer r's slot p is r*slots + p."""
    p = np.asarray(pages, dtype=np.int64)
    return (np.arange(kv.BUFFERS, dtype=np.int64)[:, None] * kv.POOL_PAGES + p[None, :]).ravel().astype(np.int32)


def writer(args, tmp):
    env = dict(os.environ)
    if args.copy_mode != "auto":
        env["PDROUTER_CUDA_COPY"] = args.copy_mode
    proxies = []
    if args.impl == "kvproxy":
        proxies = [kv.Proxy(args.kvproxy, role, args.transport, env, tmp) for role in ("prefill", "decode")]
        env["PDROUTER_KVPROXY_SOCK"] = proxies[1].sock
        os.environ["PDROUTER_KVPROXY_SOCK"] = proxies[0].sock
    child = kv.subprocess.Popen([sys.executable, os.path.abspath(__file__), "--receiver", "--impl", args.impl,
                                 "--nixl-path", args.nixl_path, "--workdir", tmp], stdin=kv.subprocess.PIPE,
                                stdout=kv.subprocess.PIPE, text=True, env=env)

    ask = kv.asker(child)
    hello = json.loads(child.stdout.readline())
    api = load_api(args.impl, args.nixl_path)
    bufs = kv.pool()
    a = agent(api, "prefill")
    t = time.perf_counter()
    register(a, bufs)
    reg_ms = (time.perf_counter() - t) * 1e3
    with open(hello["meta"], "rb") as f:
        peer = a.add_remote_agent(f.read())
    peer = peer.decode() if isinstance(peer, bytes) else peer
    local = a.prep_xfer_dlist("", strided([b.data_ptr() for b in bufs], torch.cuda.current_device()), "VRAM")
    remote = a.prep_xfer_dlist(peer, strided(hello["ptrs"], hello["dev"]), "VRAM")
    rows = []
    for pattern in args.patterns.split(","):
        for tokens in [int(x) for x in args.tokens.split(",")]:
            sp, dp = kv.page_sets(tokens, pattern)
            src, dst = indices(sp), indices(dp)
            for b in bufs:
                b.view(torch.int32).random_()
            torch.cuda.synchronize()
            ask({"op": "fill"})
            reps = max(3, args.reps // 4) if tokens >= 32768 else args.reps
            times, posts = [], []
            for i in range(args.warmup + reps):
                t = time.perf_counter()
                h = a.make_prepped_xfer("WRITE", local, src, remote, dst)
                state = a.transfer(h)
                posted = time.perf_counter()
                while state == "PROC":
                    time.sleep(0)
                    state = a.check_xfer_state(h)
                done = time.perf_counter()
                if state != "DONE":
                    raise RuntimeError("transfer ended %s" % state)
                del h
                if i >= args.warmup:
                    times.append(done - t)
                    posts.append(posted - t)
            f = os.path.join(tmp, "want.pt")
            torch.save(kv.checksums(bufs, sp).cpu(), f)
            v = ask({"op": "verify", "file": f, "pages": dp})
            total = tokens * kv.TOKEN_BYTES * kv.BUFFERS
            med = statistics.median(times)
            completes = [x - y for x, y in zip(times, posts)]
            row = {"impl": args.impl, "pattern": pattern, "tokens": tokens, "bytes": total, "descriptors": int(src.size),
                   "reps": reps, "median_us": med * 1e6, "min_us": min(times) * 1e6, "gbps": total / med / 1e9,
                   "post_median_us": statistics.median(posts) * 1e6, "post_min_us": min(posts) * 1e6,
                   "complete_median_us": statistics.median(completes) * 1e6,
                   "total_us": [x * 1e6 for x in times], "post_us": [x * 1e6 for x in posts], "verify": v,
                   "verified": v["mismatched"] == 0 and v.get("gaps_touched", 0) == 0}
            rows.append(row)
            print("%-7s %-10s %6d tok %7d descs %9.1f us %8.1f GB/s post %7.1f us complete %7.1f us verified=%s" % (
                args.impl, pattern, tokens, src.size, med * 1e6, row["gbps"], row["post_median_us"],
                row["complete_median_us"], row["verified"]), file=sys.stderr, flush=True)
    child.stdin.write(json.dumps({"op": "quit"}) + "\n")
    child.stdin.close()
    child.wait(60)
    del local, remote, a
    left = None
    if proxies:
        time.sleep(0.5)
        left = {"prefill": proxies[0].regions(), "decode": proxies[1].regions(), "link_paths": proxies[0].status()}
        for p in proxies:
            p.stop()
    label = args.impl if args.impl == "nixl" or args.copy_mode == "auto" else "kvproxy-" + args.copy_mode
    return {"impl": args.impl, "label": label, "round": args.round,
            "transport": args.transport if proxies else "UCX " + os.environ.get("UCX_TLS", "(default UCX_TLS)"),
            "register_ms": reg_ms, "rows": rows, "kvproxy": left}


def summary(out):
    """Pools the rounds in out into nixl-gpu.json; prints each kvproxy label against NIXL."""
    runs = []
    for name in sorted(os.listdir(out)):
        if name.startswith("nixl-gpu-") and name.endswith(".json") and name[9:-5].rsplit("-", 1)[-1].isdigit():
            with open(os.path.join(out, name)) as f:
                runs.append(json.load(f))
    pooled = {}  # (label, pattern, tokens) -> {"total_us", "post_us", "rounds": {round: median total}}
    for run in runs:
        for r in run["rows"]:
            p = pooled.setdefault((run.get("label", run["impl"]), r["pattern"], r["tokens"]),
                                  {"bytes": r["bytes"], "total_us": [], "post_us": [], "rounds": {}, "verified": True})
            p["total_us"] += r["total_us"]
            p["post_us"] += r["post_us"]
            p["rounds"][run.get("round", 0)] = statistics.median(r["total_us"])
            p["verified"] = p["verified"] and r["verified"]
    cases = {}
    for (label, pattern, tokens), p in sorted(pooled.items()):
        tot, post = p["total_us"], p["post_us"]
        complete = [t - q for t, q in zip(tot, post)]
        cases.setdefault("%s %d" % (pattern, tokens), {})[label] = {
            "samples": len(tot), "rounds": len(p["rounds"]), "verified": p["verified"],
            "gbps_median": p["bytes"] / statistics.median(tot) / 1e3, "gbps_best": p["bytes"] / min(tot) / 1e3,
            "total_median_us": statistics.median(tot), "total_best_us": min(tot),
            "post_median_us": statistics.median(post), "post_best_us": min(post),
            "complete_median_us": statistics.median(complete), "complete_best_us": min(complete),
            "round_medians_us": p["rounds"]}
    res = {"cases": cases, "runs": runs}
    copy = os.path.join(out, "nixl-gpu-torch.json")
    if os.path.exists(copy):
        with open(copy) as f:
            res["torch_copy"] = json.load(f)
    with open(os.path.join(out, "nixl-gpu.json"), "w") as f:
        json.dump(res, f, indent=1)
    print("%-17s %-15s %5s %17s %17s %21s" % ("case", "library", "runs", "GB/s median/best", "post us med/best",
                                                 "complete us med/best"))
    for case, libs in cases.items():
        for label, c in sorted(libs.items()):
            print("%-17s %-15s %5d %8.1f/%8.1f %8.1f/%8.1f %10.1f/%10.1f%s" % (
                case, label, c["rounds"], c["gbps_median"], c["gbps_best"], c["post_median_us"], c["post_best_us"],
                c["complete_median_us"], c["complete_best_us"], "" if c["verified"] else "  NOT VERIFIED"))
        n = libs.get("nixl")
        for label, c in sorted(libs.items()):
            if n is None or label == "nixl":
                continue
            # Rounds of both libraries pair up by number: the median of their
            # ratios is the figure least moved by drift across the call.
            paired = [n["round_medians_us"][r] / t for r, t in c["round_medians_us"].items() if r in n["round_medians_us"]]
            print("%-17s %s / NIXL: %.2f by median, %.2f by best, %.2f median of %d paired rounds" % (
                case, label, c["gbps_median"] / n["gbps_median"], c["gbps_best"] / n["gbps_best"],
                statistics.median(paired) if paired else float("nan"), len(paired)))
    return 0 if all(c["verified"] for libs in cases.values() for c in libs.values()) else 1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--receiver", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--workdir", help=argparse.SUPPRESS)
    ap.add_argument("--summary", metavar="DIR", help="pool the rounds' JSON files in DIR and compare (no GPU needed)")
    ap.add_argument("--impl", choices=("nixl", "kvproxy"))
    ap.add_argument("--round", type=int, default=0, help="which round this run is (recorded for --summary)")
    ap.add_argument("--copy-mode", choices=("auto", "kernel", "memcpy"), default="auto",
                    help="kvproxy's GPU copy (PDROUTER_CUDA_COPY); auto picks per write")
    ap.add_argument("--reps", type=int, default=20, help="timed posts a case (a quarter at 32k tokens, at least 3)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--nixl-path", default="bin/nixl")
    ap.add_argument("--kvproxy", default="bin/cuda/bin/kvproxy")
    ap.add_argument("--transport", default="tcp", help="kvproxy --transport (GPU regions on one host take the same-GPU path)")
    ap.add_argument("--tokens", default="4096,32768")
    ap.add_argument("--patterns", default="contiguous,scattered")
    ap.add_argument("--out", help="where the JSON goes (the writer)")
    args = ap.parse_args()
    if args.summary:
        sys.exit(summary(args.summary))
    if not args.impl:
        ap.error("--impl or --summary is required")
    args.nixl_path = os.path.abspath(args.nixl_path)
    load_gpu()
    if args.receiver:
        return receiver(args)
    if not args.out:
        ap.error("--out is required")
    tmp = tempfile.mkdtemp(prefix="nixl-gpu-")
    res = writer(args, tmp)
    res["gpu"] = torch.cuda.get_device_name()
    res["logs"] = {n: open(os.path.join(tmp, n)).read()[-3000:] for n in os.listdir(tmp) if n.endswith(".log")}
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    if any(not r["verified"] for r in res["rows"]):
        print("VERIFY FAILED", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
