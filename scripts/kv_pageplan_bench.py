"""CPU cost of sending SGLang's scattered batch (32k tokens: 32 layers x K,V x
2048 single-page runs = 131072 triples of 32 KiB) to kvproxy: checking and
packing it as triples (the write frame) against checking it, finding its
page write (pdrouter_kv.pageplan) and packing that. Best of --reps, in
process CPU time (the box may be shared); the
same run is the baseline.

    PYTHONPATH=python python3 scripts/kv_pageplan_bench.py
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from pdrouter_kv import control, engine, pageplan  # noqa: E402

BUFFERS, PAGE_BYTES, REGION = 64, 32768, 1 << 28


def batch(pages):
    """SGLang's order: per buffer, a triple per run (here every other page)."""
    src = [0x7F0000000000 + i * REGION for i in range(BUFFERS)]
    dst = [0x7E0000000000 + i * REGION for i in range(BUFFERS)]
    s, d, n = [], [], []
    for a, b in zip(src, dst):
        for i in range(pages):
            s.append(a + 2 * i * PAGE_BYTES)
            d.append(b + (2 * i + 1) * PAGE_BYTES)
            n.append(PAGE_BYTES)
    return s, d, n, [(a, REGION) for a in src]


def old_ints(name, values):
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(name)
        out.append(v)
    return out


def best(f, reps):
    times = []
    for _ in range(reps):
        t = time.process_time()
        f()
        times.append(time.process_time() - t)
    return min(times) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pages", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    s, d, n, regions = batch(args.pages)

    def triples(check):
        control._interleave("Q", check("s", s), check("d", d), check("n", n))

    def pages():
        found = pageplan.plan(engine._u64s("s", s), engine._u64s("d", d), engine._u64s("n", n), regions, control.MAX_PAGE_WRITE)
        for bufs, sp, dp in found[0]:
            control._interleave("Q", *zip(*bufs)), control._interleave(control._U32_CODE, sp, dp)
        return found

    found = pages()
    assert len(found[0]) == 1 and not found[1][0], "the batch should be one page write"
    arrays = [engine._u64s("v", v) for v in (s, d, n)]
    res = {"triples": len(s), "reps": args.reps,
           # before: a per-item check of each list, then the triple frame
           "triples_before_ms": best(lambda: triples(old_ints), args.reps),
           # now: the one-pass check (array('Q')), then the triple frame or the page write
           "triples_ms": best(lambda: triples(engine._u64s), args.reps),
           "page_write_ms": best(pages, args.reps),
           "check_ms": best(lambda: [engine._u64s("v", v) for v in (s, d, n)], args.reps),
           "plan_ms": best(lambda: pageplan.plan(*arrays, regions, control.MAX_PAGE_WRITE), args.reps),
           "triple_frame_bytes": 24 * len(s), "page_frame_bytes": 24 * BUFFERS + 8 * args.pages}
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
