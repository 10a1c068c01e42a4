"""What SGLang's post costs through python/nixl, this tree against a baseline
revision in the same run, on CPU (host memory registered as "VRAM", as in CI).

The calls are SGLang 0.5.23's: Nx5 strided prepared lists (one run per K/V
buffer), make_prepped_xfer("WRITE", ...) with one index per buffer and page,
transfer(), then check_xfer_state() until DONE. The layout is Llama-3.1-8B's
(64 buffers, 16-token pages), so each post names as many descriptors as on
the GPU (16384 at 4k tokens, 131072 at 32k); the pages are --page-bytes long
(256 by default instead of 32 KiB) so that both pools fit a small machine.

  post:     make_prepped_xfer + transfer, until the request is on its way;
  complete: from transfer's return until check_xfer_state says DONE;
  and the post's parts, timed apart on the same transfer (CPU time):
  plan (indices -> writes, numpy), encode (writes -> control frames), send
  (the frames onto kvproxy's socket, wall time); ranges: what the request
  names (buffers x pages of a page write, or triples).

Each round runs each tree in a fresh process against the same two kvproxies,
the trees alternating (old, new, new, old, ...) so that drift on a busy
machine hits both alike. Post figures are wall time (median and best) and
the posting thread's CPU time, which a busy machine disturbs less.

    python3 scripts/nixl_post_bench.py --baseline main        # needs numpy
"""
import argparse
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUFFERS, PAGE_TOKENS = 64, 16
CASES = [(tokens, pattern) for tokens in (4096, 32768) for pattern in ("contiguous", "every-other")]
POOL_PAGES = 2 * 32768 // PAGE_TOKENS + 8  # room for every other page of 32k tokens


def pages(tokens, pattern):
    n = tokens // PAGE_TOKENS
    if pattern == "contiguous":
        return list(range(n)), list(range(n))
    return [2 * i for i in range(n)], [2 * i + 1 for i in range(n)]


def child(args):
    """One tree's round: prints {case: {post, post_cpu, complete: [seconds]}}."""
    import numpy as np
    from nixl._api import nixl_agent, nixl_agent_config

    def agent(sock, name):
        os.environ["PDROUTER_KVPROXY_SOCK"] = sock
        a = nixl_agent(name, nixl_agent_config(backends=[]))
        a.create_backend("UCX", {})
        return a

    def pool():
        return [np.frombuffer(mmap.mmap(-1, POOL_PAGES * args.page_bytes), dtype=np.uint8) for _ in range(BUFFERS)]

    def strided(bufs):
        return np.array([(b.ctypes.data, args.page_bytes, 0, args.page_bytes, POOL_PAGES) for b in bufs], dtype=np.uint64)

    def indices(p):
        return (np.arange(BUFFERS, dtype=np.int64)[:, None] * POOL_PAGES + np.asarray(p)[None, :]).ravel().astype(np.int32)

    prefill, decode = agent(args.sock_prefill, "prefill"), agent(args.sock_decode, "decode")
    src, dst = pool(), pool()
    prefill.register_memory([(b.ctypes.data, b.nbytes, 0, "") for b in src], "VRAM")
    decode.register_memory([(b.ctypes.data, b.nbytes, 0, "") for b in dst], "VRAM")
    peer = prefill.add_remote_agent(decode.get_agent_metadata())
    local = prefill.prep_xfer_dlist("", strided(src), "VRAM")
    remote = prefill.prep_xfer_dlist(peer, strided(dst), "VRAM")
    from pdrouter_kv import xferplan

    core = prefill._core
    src_list, dst_list = core.dlists[local._handle], core.dlists[remote._handle]
    client, kvproxy = prefill._engine().control(), core.remotes[peer].kvproxy
    out = {}
    for tokens, pattern in CASES:
        sp, dp = pages(tokens, pattern)
        si, di = indices(sp), indices(dp)
        reps = args.reps if tokens < 32768 else max(3, args.reps // 2)
        post, post_cpu, complete = [], [], []
        parts = {"plan_cpu": [], "encode_cpu": [], "send": []}
        for i in range(args.warmup + reps):
            c0 = time.thread_time()
            writes = xferplan.plan(src_list, si, dst_list, di)
            c1 = time.thread_time()
            frames = xferplan.frames(client, kvproxy, writes)
            c2, t2 = time.thread_time(), time.perf_counter()
            sent = [client.post(op, body) for op, body in frames]
            t3 = time.perf_counter()
            for p in sent:
                client.wait(p)
            if i >= args.warmup:
                parts["plan_cpu"].append(c1 - c0)
                parts["encode_cpu"].append(c2 - c1)
                parts["send"].append(t3 - t2)
        ranges = sum(len(w[1]) * len(w[2]) if w[0] == "pages" else len(w[1]) for w in writes)
        for i in range(args.warmup + reps):
            c0, t0 = time.thread_time(), time.perf_counter()
            h = prefill.make_prepped_xfer("WRITE", local, si, remote, di)
            state = prefill.transfer(h)
            t1, c1 = time.perf_counter(), time.thread_time()
            while state == "PROC":
                time.sleep(0)
                state = prefill.check_xfer_state(h)
            t2 = time.perf_counter()
            if state != "DONE":
                raise RuntimeError("%d tokens %s: the transfer ended %s" % (tokens, pattern, state))
            del h
            if i >= args.warmup:
                post.append(t1 - t0)
                post_cpu.append(c1 - c0)
                complete.append(t2 - t1)
        out["%d %s" % (tokens, pattern)] = dict(parts, post=post, post_cpu=post_cpu, complete=complete, ranges=[ranges])
    del local, remote
    prefill.close()
    decode.close()
    json.dump(out, sys.stdout)


def tree(rev, tmp):
    """The python/ directory of rev ("" for this working tree)."""
    if not rev:
        return os.path.join(REPO, "python")
    where = tempfile.mkdtemp(prefix="post-bench-", dir=tmp)
    archive = subprocess.run(["git", "-C", REPO, "archive", rev, "python"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", where], input=archive, check=True)
    return os.path.join(where, "python")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--sock-prefill", help=argparse.SUPPRESS)
    ap.add_argument("--sock-decode", help=argparse.SUPPRESS)
    ap.add_argument("--baseline", default="main", help="git revision to compare against (default main)")
    ap.add_argument("--kvproxy", help="kvproxy binary (default: $KVPROXY, else built from the tree)")
    ap.add_argument("--transport", default="shm", help="kvproxy --transport (default shm, the same-host path)")
    ap.add_argument("--page-bytes", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=4, help="rounds of each tree (default 4)")
    ap.add_argument("--reps", type=int, default=20, help="posts a case in each round (half at 32k tokens)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", help="also write the figures here as JSON")
    args = ap.parse_args()
    if args.child:
        return child(args)

    sys.path.insert(0, os.path.join(REPO, "python"))
    if args.kvproxy:
        os.environ["KVPROXY"] = os.path.abspath(args.kvproxy)
    from tests.kvproxy_proc import KVProxy

    tmp = tempfile.mkdtemp(prefix="nixl-post-bench-")
    trees = {"old": tree(args.baseline, tmp), "new": tree("", tmp)}
    proxies = [KVProxy(role, args.transport) for role in ("prefill", "decode")]
    samples = {name: {} for name in trees}
    try:
        for r in range(args.rounds):
            for name in (("old", "new") if r % 2 == 0 else ("new", "old")):
                env = dict(os.environ, PYTHONPATH=trees[name])
                res = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--sock-prefill", proxies[0].sock,
                                      "--sock-decode", proxies[1].sock, "--page-bytes", str(args.page_bytes),
                                      "--reps", str(args.reps), "--warmup", str(args.warmup)],
                                     env=env, check=True, capture_output=True, text=True, cwd=trees[name])
                for case, v in json.loads(res.stdout).items():
                    for k, xs in v.items():
                        samples[name].setdefault(case, {}).setdefault(k, []).extend(xs)
    finally:
        for p in proxies:
            p.stop()

    def us(xs, f):
        return f(xs) * 1e6

    print("python/nixl post (make_prepped_xfer + transfer) and completion, %s (old) vs this tree (new)" % args.baseline)
    print("Llama-3.1-8B layout (64 buffers, 16-token pages of %d bytes here), kvproxy --transport %s, %d rounds each, alternating"
          % (args.page_bytes, args.transport, args.rounds))
    print("%-20s %-5s %19s %12s %19s %9s %10s %8s %7s" % ("case", "tree", "post us med/best", "post cpu us", "complete us med/best",
                                                          "plan cpu", "encode cpu", "send us", "ranges"))
    table = {}
    for case in samples["new"]:
        for name in ("old", "new"):
            v = samples[name][case]
            row = {"post_median_us": us(v["post"], statistics.median), "post_best_us": us(v["post"], min),
                   "post_cpu_median_us": us(v["post_cpu"], statistics.median),
                   "complete_median_us": us(v["complete"], statistics.median), "complete_best_us": us(v["complete"], min),
                   "plan_cpu_median_us": us(v["plan_cpu"], statistics.median),
                   "encode_cpu_median_us": us(v["encode_cpu"], statistics.median),
                   "send_median_us": us(v["send"], statistics.median), "ranges": v["ranges"][0], "posts": len(v["post"])}
            table.setdefault(case, {})[name] = row
            print("%-20s %-5s %9.1f/%9.1f %12.1f %9.1f/%9.1f %9.1f %10.1f %8.1f %7d" % (
                case, name, row["post_median_us"], row["post_best_us"], row["post_cpu_median_us"], row["complete_median_us"],
                row["complete_best_us"], row["plan_cpu_median_us"], row["encode_cpu_median_us"], row["send_median_us"], row["ranges"]))
        o, n = table[case]["old"], table[case]["new"]
        print("%-20s new/old: post %.2f (cpu %.2f), complete %.2f" % (
            case, n["post_median_us"] / o["post_median_us"], n["post_cpu_median_us"] / o["post_cpu_median_us"],
            n["complete_median_us"] / o["complete_median_us"]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"baseline": args.baseline, "page_bytes": args.page_bytes, "transport": args.transport,
                       "rounds": args.rounds, "cases": table}, f, indent=1)


if __name__ == "__main__":
    main()
