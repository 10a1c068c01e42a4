"""The ceilings of the KV benchmarks at the given sizes (bytes moved one way
/ time): device-to-device copies through torch, pinned device-to-host and
host-to-device copies (the staged path's gather and scatter), and a TCP
loopback socket between two threads (the staged path's wire here)."""
import json
import socket
import sys
import threading
import time

import torch


def timed(fn, size, iters):
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return size * iters / (start.elapsed_time(end) / 1e3) / 1e9


def copy_rates(size, iters):
    src = torch.empty(size, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    row = {"size": size, "gbps": timed(lambda: dst.copy_(src), size, iters)}
    assert torch.equal(dst, src)
    row["d2h_pinned_gbps"] = timed(lambda: host.copy_(src, non_blocking=True), size, iters)
    row["h2d_pinned_gbps"] = timed(lambda: dst.copy_(host, non_blocking=True), size, iters)
    assert torch.equal(dst, src)
    return row


def tcp_loopback_gbps(size, total):
    """One connection over 127.0.0.1, size-byte sends, total bytes."""
    ln = socket.create_server(("127.0.0.1", 0))
    buf = bytearray(size)
    got = [0]

    def receive():
        c, _ = ln.accept()
        view = memoryview(bytearray(size))
        while got[0] < total:
            n = c.recv_into(view)
            if n == 0:
                break
            got[0] += n
        c.close()

    th = threading.Thread(target=receive)
    th.start()
    s = socket.create_connection(ln.getsockname())
    t = time.perf_counter()
    for _ in range(total // size):
        s.sendall(buf)
    th.join()
    dt = time.perf_counter() - t
    s.close()
    ln.close()
    return total / dt / 1e9


def main():
    sizes = [int(s) for s in sys.argv[1].split(",")] if len(sys.argv) > 1 else [64 << 10, 1 << 20, 16 << 20, 256 << 20, 1 << 30]
    rows = [copy_rates(s, max(10, min(2000, (8 << 30) // s))) for s in sizes]
    wire = [{"send_bytes": n, "gbps": tcp_loopback_gbps(n, 4 << 30)} for n in (1 << 20, 8 << 20)]
    json.dump({"copies": rows, "tcp_loopback": wire}, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
