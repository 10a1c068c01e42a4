"""GPU KV transfer through kvproxy on one GPU (make bench-kv-gpu, run on the
GPU machine). Two engine processes (this one as prefill, a child as decode),
each with its own kvproxy, hold the Llama-3.1-8B KV layout on the GPU
(32 layers x K and V, 8 heads x 128 x bf16 = 2 KiB a token, page 16 =
32 KiB a page a buffer) and register it with their kvproxy by CUDA IPC
handle. The prefill engine writes 128..32k tokens of pages, contiguous or
every other page, into the decode engine's pool through kvproxy: contiguous
as triples merged like SGLang's group_concurrent_contiguous; scattered as
one page write (Client.write_pages: 64 buffers x page pairs) and, for
comparison, as a triple per page (scattered-triples); scattered-sglang is
SGLang's unchanged call, the triple per page through the Mooncake-compatible
TransferEngine.batch_transfer_sync_write (which finds the page write in it),
timed end to end, checking and planning included; every received page is
checksummed on the GPU against the sender's, and the pages between them
must be untouched.

    PYTHONPATH=python python3 scripts/kv_gpu_bench.py --kvproxy bin/cuda/bin/kvproxy --out kv-gpu.json
"""
import argparse
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from pdrouter_kv import control, engine, pageplan  # noqa: E402

LAYERS, HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
TOKEN_BYTES = HEADS * HEAD_DIM * 2
PAGE_BYTES = PAGE * TOKEN_BYTES
BUFFERS = 2 * LAYERS
TOKENS = [128, 1024, 4096, 32768]
POOL_PAGES = 2 * max(TOKENS) // PAGE + 8  # room for every other page of 32k tokens
FILL = 0x3EEE  # what decode pages hold before a transfer
MAX_CALL = control.MAX_TRIPLES  # triples per control call (kvproxy's 16 MiB frame)
PATTERNS = ("contiguous", "scattered", "scattered-triples", "scattered-sglang")


def pool():
    """One tensor per layer for K and one for V, as SGLang's MHATokenToKVPool."""
    return [torch.empty(POOL_PAGES * PAGE, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda") for _ in range(BUFFERS)]


def register(client, bufs):
    for b in bufs:
        client.register_cuda_memory(b.data_ptr(), b.numel() * b.element_size())


_weights = None


def checksums(bufs, pages):
    """[buffers, len(pages), 2] int64: sum and position-weighted sum of each page's int32 words."""
    global _weights
    words = PAGE_BYTES // 4
    if _weights is None:
        _weights = torch.arange(1, words + 1, dtype=torch.int64, device="cuda")
    idx = torch.tensor(pages, dtype=torch.int64, device="cuda")
    out = []
    for b in bufs:
        p = b.view(torch.int32).view(POOL_PAGES, words).index_select(0, idx).to(torch.int64)
        out.append(torch.stack([p.sum(1), (p * _weights).sum(1)], 1))
    return torch.stack(out)


def page_sets(tokens, pattern):
    n = tokens // PAGE
    if pattern == "contiguous":
        return list(range(n)), list(range(n))
    # scattered, either form: every other page on both sides.
    return [2 * i for i in range(n)], [2 * i + 1 for i in range(n)]


def triples(src_ptrs, dst_ptrs, src_pages, dst_pages):
    """Per-page ranges with runs contiguous on both sides merged."""
    s, d, n = [], [], []
    for sp, dp in zip(src_ptrs, dst_ptrs):
        for a, b in zip(src_pages, dst_pages):
            sa, da = sp + a * PAGE_BYTES, dp + b * PAGE_BYTES
            if n and s[-1] + n[-1] == sa and d[-1] + n[-1] == da:
                n[-1] += PAGE_BYTES
            else:
                s.append(sa), d.append(da), n.append(PAGE_BYTES)
    return s, d, n


# Decode engine: a child process driven by JSON lines on stdin.

def decode_engine(sock):
    torch.cuda.init()
    bufs = pool()
    cl = control.Client(sock)
    peer, transport = cl.hello()
    register(cl, bufs)
    reply({"peer": peer, "transport": transport, "ptrs": [b.data_ptr() for b in bufs]})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "fill":
            for b in bufs:
                b.view(torch.int16).fill_(FILL)
            torch.cuda.synchronize()
            reply({})
        elif cmd["op"] == "verify":
            reply(verify(bufs, cmd))
        elif cmd["op"] == "quit":
            break
    cl.close()  # kvproxy drops every region of this engine


def verify(bufs, cmd):
    want = torch.load(cmd["file"]).cuda()
    got = checksums(bufs, cmd["pages"])
    bad = (got != want).any(2)
    res = {"pages": int(bad.numel()), "mismatched": int(bad.sum())}
    if res["mismatched"]:
        b, i = (bad.nonzero()[0]).tolist()
        res["first"] = {"buffer": b, "page": cmd["pages"][i]}
    # Pages between the received ones must still hold the fill.
    gaps = sorted(set(range(max(cmd["pages"]) + 2)) - set(cmd["pages"]))
    if gaps:
        g = checksums(bufs, gaps)
        fill = torch.full((PAGE_BYTES // 2,), FILL, dtype=torch.int16, device="cuda").view(torch.int32).to(torch.int64)
        ref = torch.stack([fill.sum(), (fill * _weights).sum()])
        res["gaps"], res["gaps_touched"] = len(gaps) * BUFFERS, int((g != ref).any(2).sum())
    return res


def asker(child):
    """ask(obj): one JSON line to the engine child, its JSON line back."""
    def ask(obj):
        child.stdin.write(json.dumps(obj) + "\n")
        child.stdin.flush()
        line = child.stdout.readline()
        if not line:
            raise RuntimeError("the receiving engine died")
        return json.loads(line)
    return ask


def reply(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


# Prefill engine and driver.

class Proxy:
    def __init__(self, binary, role, transport, env, logdir, host_id="", stage_chunk=0):
        self.sock = os.path.join(logdir, role + ".sock")
        argv = [binary, "--role", role, "--transport", transport, "--control", self.sock, "--host", "127.0.0.1",
                "--metrics-port", "0", "--log-level", "warn"]
        if host_id:  # a host id of its own: the peer is remote (staged path)
            argv += ["--host-id", host_id]
        if stage_chunk:
            argv += ["--stage-chunk", str(stage_chunk)]
        if role == "prefill":
            argv += ["--bootstrap-port", "0"]
        self.log = open(os.path.join(logdir, role + ".log"), "a")
        self.p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=self.log, text=True)
        line = self.p.stdout.readline()
        if not line.startswith("kvproxy ready"):
            self.p.kill()
            raise RuntimeError("kvproxy %s did not start: %r (log %s)" % (role, line, self.log.name))
        self.fields = dict(kv.split("=", 1) for kv in line.split()[2:])

    def metric(self, name):
        import urllib.request
        text = urllib.request.urlopen("http://%s/metrics" % self.fields["metrics"], timeout=5).read().decode()
        return sum(float(l.split()[-1]) for l in text.splitlines() if l.split(" ")[0].split("{")[0] == name)

    def status(self):
        import urllib.request
        return json.loads(urllib.request.urlopen("http://%s/status" % self.fields["metrics"], timeout=5).read())

    def regions(self):
        return self.metric("kvproxy_registered_regions")

    def stop(self):
        self.p.terminate()
        try:
            self.p.wait(10)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()


def run_mode(args, mode, tmp):
    env = dict(os.environ)
    if mode != "auto":
        env["PDROUTER_CUDA_COPY"] = mode
    ids = args.host_ids.split(",") if args.host_ids else ["", ""]
    pp = Proxy(args.kvproxy, "prefill", args.transport, env, tmp, ids[0], args.stage_chunk)
    dp = Proxy(args.kvproxy, "decode", args.transport, env, tmp, ids[1], args.stage_chunk)
    child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--engine", dp.sock], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)

    ask = asker(child)
    hello = json.loads(child.stdout.readline())
    bufs_gpu = pool()
    # SGLang's engine; its control connection serves the prepacked calls too.
    os.environ["PDROUTER_KVPROXY_SOCK"] = pp.sock
    te = engine.TransferEngine()
    if te.initialize("127.0.0.1", "P2PHANDSHAKE", args.transport, "") != 0:
        raise RuntimeError("TransferEngine.initialize failed")
    cl = te._client
    t0 = time.perf_counter()
    if te.batch_register_memory([b.data_ptr() for b in bufs_gpu], [b.numel() * b.element_size() for b in bufs_gpu]) != 0:
        raise RuntimeError("TransferEngine.batch_register_memory failed")
    reg_us = (time.perf_counter() - t0) * 1e6 / BUFFERS
    src_ptrs = [b.data_ptr() for b in bufs_gpu]
    # The control floor: a write of nothing (one control round trip).
    peer = hello["peer"].encode()
    empty = struct.pack("<I", len(peer)) + peer + struct.pack("<I", 0)
    floor = []
    for i in range(60):
        t = time.perf_counter()
        cl._call(control.OP_WRITE, empty)
        if i >= 10:
            floor.append(time.perf_counter() - t)
    rows = []
    for pattern in args.patterns.split(","):
        for tokens in [int(t) for t in args.tokens.split(",")]:
            sp, dpages = page_sets(tokens, pattern)
            pages = pattern == "scattered"
            sglang = pattern == "scattered-sglang"
            s, d, n = triples(src_ptrs, hello["ptrs"], sp, dpages)
            calls = [(s[i:i + MAX_CALL], d[i:i + MAX_CALL], n[i:i + MAX_CALL]) for i in range(0, len(s), MAX_CALL)]
            head = struct.pack("<I", len(peer)) + peer
            if pages:
                # One page write: every buffer, the same page pairs.
                bufs = [(a, b, PAGE_BYTES) for a, b in zip(src_ptrs, hello["ptrs"])]
                pairs = b"".join(struct.pack("<II", a, b) for a, b in zip(sp, dpages))
                tail = struct.pack("<I", len(pairs) // 8) + pairs
                bodies = [head + struct.pack("<I", len(bufs)) + b"".join(struct.pack("<QQQ", *b) for b in bufs) + tail]
                # The control path: the same frame with a zero page length,
                # which kvproxy reads, decodes and refuses before any work.
                bad = [head + struct.pack("<I", len(bufs)) + b"".join(struct.pack("<QQQ", a, b, 0 if i == 0 else l)
                                                                       for i, (a, b, l) in enumerate(bufs)) + tail]
                op = control.OP_WRITE_PAGES

                def client_call():
                    cl.write_pages(hello["peer"], bufs, sp, dpages)
            elif sglang:
                bodies = bad = None
                op = None

                def client_call():
                    if te.batch_transfer_sync_write(hello["peer"], s, d, n) != 0:
                        raise RuntimeError("batch_transfer_sync_write failed")
            else:
                # The same calls prepacked: kvproxy's time without Python's packing.
                bodies = [head + struct.pack("<I", len(c[0])) + b"".join(struct.pack("<QQQ", *t) for t in zip(*c)) for c in calls]
                # The control path: the same frames with an unregistered
                # first source, which kvproxy reads, decodes and refuses.
                bad = [body[:len(body) - 24 * len(c[0])] + struct.pack("<QQQ", 8, 8, 8) + body[len(body) - 24 * len(c[0]) + 24:]
                       for body, c in zip(bodies, calls)]
                op = control.OP_WRITE

                def client_call():
                    for c in calls:
                        cl.write(hello["peer"], *c)
            for b in bufs_gpu:
                b.view(torch.int32).random_()
            torch.cuda.synchronize()
            ask({"op": "fill"})
            reps = 5 if tokens >= 32768 else 20
            times, e2e = [], []
            m0 = (pp.metric("kvproxy_gpu_write_resolve_seconds_total"), pp.metric("kvproxy_gpu_write_copy_seconds_total"))
            for i in range(3 + reps):
                t = time.perf_counter()
                if sglang:  # what SGLang waits for: no prepacked form
                    client_call()
                for body in bodies or ():
                    cl._call(op, body)
                if i >= 3:
                    times.append(time.perf_counter() - t)
            m1 = (pp.metric("kvproxy_gpu_write_resolve_seconds_total"), pp.metric("kvproxy_gpu_write_copy_seconds_total"))
            for i in range(1 + min(reps, 5)):
                t = time.perf_counter()
                client_call()
                if i >= 1:
                    e2e.append(time.perf_counter() - t)
            ctl = []
            for i in range(2 + reps if bad else 0):
                t = time.perf_counter()
                for body in bad:
                    try:
                        cl._call(op, body)
                    except control.KVProxyError:
                        pass
                    else:
                        raise RuntimeError("kvproxy accepted a bad write")
                if i >= 2:
                    ctl.append(time.perf_counter() - t)
            plan = None
            if sglang:  # how the engine sent it, and what finding that cost
                def planned():
                    return pageplan.plan(*(engine._u64s("v", v) for v in (s, d, n)), list(te._cuda.items()), control.MAX_PAGE_WRITE)
                found = planned()
                plan_s = []
                for _ in range(5):
                    t = time.perf_counter()
                    planned()
                    plan_s.append(time.perf_counter() - t)
                plan = {"page_writes": len(found[0]) if found else 0, "triples_left": len(found[1][0]) if found else len(s),
                        "check_and_plan_us": min(plan_s) * 1e6}
            f = os.path.join(tmp, "want.pt")
            torch.save(checksums(bufs_gpu, sp).cpu(), f)
            v = ask({"op": "verify", "file": f, "pages": dpages})
            total = tokens * TOKEN_BYTES * BUFFERS
            med = statistics.median(times)
            row = {"mode": mode, "pattern": pattern, "tokens": tokens, "bytes": total, "runs": len(s),
                   "calls": 1 if pages else len(calls), "frame_bytes": sum(len(b) for b in bodies or ()),
                   "reps": reps, "median_us": med * 1e6, "min_us": min(times) * 1e6, "max_us": max(times) * 1e6,
                   "gbps": total / med / 1e9, "run_bytes": n[0], "verify": v,
                   "client_write_median_us": statistics.median(e2e) * 1e6,
                   "control_path_us": statistics.median(ctl) * 1e6 if ctl else None,
                   # kvproxy's own time per write (means over the prepacked writes, warm-up included)
                   "kvproxy_resolve_us": (m1[0] - m0[0]) / (3 + reps) * 1e6, "kvproxy_copy_us": (m1[1] - m0[1]) / (3 + reps) * 1e6,
                   "verified": v["mismatched"] == 0 and v.get("gaps_touched", 0) == 0}
            if plan:
                row["plan"] = plan
            rows.append(row)
            print("%-7s %-17s %6d tok %7d runs %9.1f us %8.1f GB/s (resolve %.0f us, copy %.0f us, control %.0f us, client call %.0f us, "
                  "frame %d B) verified=%s" % (mode, pattern, tokens, len(s), med * 1e6, row["gbps"], row["kvproxy_resolve_us"],
                                               row["kvproxy_copy_us"], row["control_path_us"] or 0, row["client_write_median_us"],
                                               row["frame_bytes"], row["verified"]), plan or "", file=sys.stderr, flush=True)
    paths = pp.status()
    child.stdin.write(json.dumps({"op": "quit"}) + "\n")
    child.stdin.close()
    child.wait(30)
    te.close()
    time.sleep(0.5)
    left = {"prefill": pp.regions(), "decode": dp.regions()}
    pp.stop()
    dp.stop()
    return {"mode": mode, "transport": hello["transport"], "host_ids": ids, "stage_chunk": args.stage_chunk, "link_paths": paths,
            "register_us_per_buffer": reg_us, "rows": rows,
            "control_floor_us": statistics.median(floor) * 1e6,
            "regions_after_close": left}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", help=argparse.SUPPRESS)
    ap.add_argument("--kvproxy", default="bin/cuda/bin/kvproxy")
    ap.add_argument("--transport", default="ucx")
    ap.add_argument("--modes", default="auto,kernel,memcpy")
    ap.add_argument("--out", default="bench/out/kv-gpu.json")
    ap.add_argument("--stage-chunk", type=int, default=0, help="kvproxy --stage-chunk (0: its default)")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--patterns", default=",".join(PATTERNS))
    ap.add_argument("--host-ids", default="", help="A,B: the two kvproxies' --host-id (different: the staged cross-host path)")
    args = ap.parse_args()
    if args.engine:
        return decode_engine(args.engine)
    tmp = tempfile.mkdtemp(prefix="kv-gpu-")
    res = {"gpu": torch.cuda.get_device_name(), "layout": {"layers": LAYERS, "buffers": BUFFERS, "page_tokens": PAGE,
           "page_bytes": PAGE_BYTES, "token_bytes_per_buffer": TOKEN_BYTES}, "runs": []}
    for mode in args.modes.split(","):
        res["runs"].append(run_mode(args, mode, tmp))
    res["logs"] = {n: open(os.path.join(tmp, n)).read()[-3000:] for n in os.listdir(tmp) if n.endswith(".log")}
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    bad = [r for run in res["runs"] for r in run["rows"] if not r["verified"]]
    if bad:
        print("VERIFY FAILED: %d configurations" % len(bad), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
