#!/usr/bin/env python3
"""Where the direct small-write path (pdrouter_kv.direct) stops paying: one
write of each size through kvproxy and straight to the peer kvproxy, in
alternation, between two kvproxies over tcp (median µs per call over the
rounds' medians). What chose direct.MAX_BYTES.

  KVPROXY=bin/kvproxy nice -n 10 python3 python/harness/direct_bound.py
"""

import ctypes
import mmap
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from pdrouter_kv import control, direct  # noqa: E402
from tests.kvproxy_proc import KVProxy  # noqa: E402

SIZES = [(64, 1), (4096, 1), (16 * 4096, 16), (64 << 10, 1), (256 << 10, 1), (1 << 20, 1)]


def main(rounds=3):
    kp = [KVProxy("prefill"), KVProxy("decode")]
    a, b = control.Client(kp[0].sock), control.Client(kp[1].sock)
    try:
        peer, _ = b.hello()
        a.hello()
        n = 4 << 20
        maps = [mmap.mmap(-1, n) for _ in range(2)]
        sa, sb = (ctypes.addressof((ctypes.c_char * n).from_buffer(m)) for m in maps)
        a.register_host_memory(sa, n)
        b.register_host_memory(sb, n)
        direct.MAX_BYTES = n  # every size may go direct; _DIRECT picks the path
        res = {}
        for _ in range(rounds):
            for size, ranges in SIZES:
                per = size // ranges
                srcs, dsts = [sa + 2 * per * i for i in range(ranges)], [sb + 2 * per * i for i in range(ranges)]
                for d in (True, False):
                    control._DIRECT = d
                    ts = []
                    for _ in range(300 if size <= 64 << 10 else 100):
                        t = time.perf_counter()
                        a.write(peer, srcs, dsts, [per] * ranges)
                        ts.append(time.perf_counter() - t)
                    res.setdefault((size, ranges, d), []).append(statistics.median(ts) * 1e6)
        for size, ranges in SIZES:
            d, k = (statistics.median(res[(size, ranges, x)]) for x in (True, False))
            print("%8d B in %2d ranges: direct %7.1f µs, through kvproxy %7.1f µs (%.2fx)" % (size, ranges, d, k, k / d))
        assert a.direct_writes > 0
    finally:
        a.close()
        b.close()
        for k in kp:
            k.stop()


if __name__ == "__main__":
    main()
