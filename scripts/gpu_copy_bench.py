"""Device-to-device copy bandwidth through torch at the given sizes: the
GPU's own ceiling for the KV benchmarks (bytes copied one way / time)."""
import json
import sys

import torch


def copy_gbps(size, iters):
    src = torch.empty(size, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    end.synchronize()
    assert torch.equal(dst, src)
    return size * iters / (start.elapsed_time(end) / 1e3) / 1e9


def main():
    sizes = [int(s) for s in sys.argv[1].split(",")] if len(sys.argv) > 1 else [64 << 10, 1 << 20, 16 << 20, 256 << 20, 1 << 30]
    rows = [{"size": s, "gbps": copy_gbps(s, max(10, min(2000, (8 << 30) // s)))} for s in sizes]
    json.dump(rows, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
