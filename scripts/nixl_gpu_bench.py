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
"""
import argparse
import importlib
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, here)
import kv_gpu_bench as kv  # noqa: E402


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
            reps = 5 if tokens >= 32768 else 20
            times, posts = [], []
            for i in range(3 + reps):
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
                if i >= 3:
                    times.append(done - t)
                    posts.append(posted - t)
            f = os.path.join(tmp, "want.pt")
            torch.save(kv.checksums(bufs, sp).cpu(), f)
            v = ask({"op": "verify", "file": f, "pages": dp})
            total = tokens * kv.TOKEN_BYTES * kv.BUFFERS
            med = statistics.median(times)
            row = {"impl": args.impl, "pattern": pattern, "tokens": tokens, "bytes": total, "descriptors": int(src.size),
                   "reps": reps, "median_us": med * 1e6, "min_us": min(times) * 1e6, "gbps": total / med / 1e9,
                   "post_median_us": statistics.median(posts) * 1e6, "verify": v,
                   "verified": v["mismatched"] == 0 and v.get("gaps_touched", 0) == 0}
            rows.append(row)
            print("%-7s %-10s %6d tok %7d descs %9.1f us %8.1f GB/s post %7.1f us verified=%s" % (
                args.impl, pattern, tokens, src.size, med * 1e6, row["gbps"], row["post_median_us"], row["verified"]),
                file=sys.stderr, flush=True)
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
    return {"impl": args.impl, "transport": args.transport if proxies else "UCX " + os.environ.get("UCX_TLS", "(default UCX_TLS)"),
            "register_ms": reg_ms, "rows": rows, "kvproxy": left}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--receiver", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--workdir", help=argparse.SUPPRESS)
    ap.add_argument("--impl", choices=("nixl", "kvproxy"), required=True)
    ap.add_argument("--nixl-path", default="bin/nixl")
    ap.add_argument("--kvproxy", default="bin/cuda/bin/kvproxy")
    ap.add_argument("--transport", default="tcp", help="kvproxy --transport (GPU regions on one host take the same-GPU path)")
    ap.add_argument("--tokens", default="4096,32768")
    ap.add_argument("--patterns", default="contiguous,scattered")
    ap.add_argument("--out", help="where the JSON goes (the writer)")
    args = ap.parse_args()
    args.nixl_path = os.path.abspath(args.nixl_path)
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
