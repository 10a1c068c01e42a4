#!/usr/bin/env bash
# make bench-kv-gpu: builds the CUDA bundle here (make cuda-bundle), then run
# THIS script on the GPU machine from the repo root (device tool, carry
# bin/cuda): GPU unit tests (cuda, ucx, kvtransfer's GPU and staged tests),
# the KV transfer benchmark between two engine processes through their
# kvproxies (scripts/kv_gpu_bench.py) on the same-host path and, with two
# host ids, on the staged cross-host path over tcp (staged-tcp) and over
# ucx (staged-ucx: RMA into the receiver's staging ring; UCX_TLS=tcp and
# PDROUTER_STAGE_PUTS=1, the machine has no RDMA NIC), and in the same call
# the ceilings:
# ucx_perftest -m cuda,cuda (with ucxbench) at the per-run message sizes
# over cuda_ipc, UCX's own staging of CUDA memory over tcp (tcp,cuda_copy,
# ucx_perftest run directly: see perf_cuda_tcp), host memory over UCX's tcp,
# our tcp link's host-to-host rate (BenchmarkStagedWrite/host-tcp), torch
# device, pinned device-to-host and host-to-device copies, and a TCP
# loopback socket. Results in $OUT (or bench/out): kv-gpu.json
# (everything), summary.txt (the rows), bench-kv-gpu.log. KV_SCRIPTS
# (default scripts) is where the Python benchmarks are; STAGED_TOKENS and
# STAGED_PATTERNS narrow the staged runs, STAGED_MODES (auto) forces their
# gather and scatter copies too (e.g. auto,memcpy); STEPS picks the parts (default
# all: "tests same staged staged-ucx ceilings"), so one 10-minute device
# call need not hold everything.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench/out}
mkdir -p "$out"
b=${CUDA_BUNDLE:-$PWD/bin/cuda}
sc=${KV_SCRIPTS:-scripts}
export PYTHONPATH=$PWD/python LD_LIBRARY_PATH=$b/lib PATH=$b/bin:$PATH PYTHONUNBUFFERED=1
run() { echo "== $*"; "$@"; local rc=$?; echo "rc=$rc"; return $rc; }
want() { [[ " ${STEPS:-tests same staged staged-ucx ceilings} " == *" $1 "* ]]; }
# perf_cuda_tcp SIZE prints "ucx_perftest cuda-over-tcp TEST SIZE MB/s"
# for UCX_TLS=tcp,cuda_copy, both buffers device memory: UCX stages them
# through its own host bounce buffers. ucxbench's suite sized each point
# for cuda_ipc (32 GiB, 32 puts outstanding), which over tcp never finished
# a 2 MiB point (ucx_perftest's 30 s peer timeout, then a reset). Here a
# point is about 256 MiB (at least 16 puts) with 4 outstanding, each pair
# under a 30 s timeout; ucp_put_bw first, then ucp_am_bw and tag_bw (other
# protocols of the same pipeline) if it does not complete. UCX_RNDV_THRESH
# and the tcp segment sizes stay UCX's defaults. Column 6 of perftest's
# final line is its overall bandwidth (UCX's MB: 2^20 bytes). PERF_MEM=host
# tries the function on a machine without a GPU.
perf_cuda_tcp() {
	local size=$1 iters port line test
	iters=$((256 * 1048576 / size))
	[ "$iters" -lt 16 ] && iters=16
	for test in ucp_put_bw ucp_am_bw tag_bw; do
		port=$((15000 + RANDOM % 2000))
		UCX_TLS=tcp,cuda_copy timeout 30 ucx_perftest -p "$port" -c 0 >/dev/null 2>&1 &
		local srv=$!
		sleep 0.5
		line=$(UCX_TLS=tcp,cuda_copy timeout 30 ucx_perftest 127.0.0.1 -p "$port" -c 1 -t "$test" -s "$size" \
			-n "$iters" -w 2 -O 4 -m "${PERF_MEM:-cuda,cuda}" -f 2>&1 | tail -1)
		kill "$srv" 2>/dev/null
		wait "$srv" 2>/dev/null
		set -- $line
		if [ $# -ge 6 ] && [[ $6 =~ ^[0-9.]+$ ]]; then
			echo "ucx_perftest cuda-over-tcp $test $size ${6} MB/s ($iters iterations)"
			return 0
		fi
		echo "ucx_perftest cuda-over-tcp $test $size did not complete: $line"
	done
}
{
	nvidia-smi -L
	if want tests; then
		(cd cuda && run "$b/bin/cuda.test" -test.v -test.count=1)
		(cd ucx && run "$b/bin/ucx.test" -test.v -test.count=1 -test.run 'CUDA|MapAddr')
		(cd python && run python3 -m unittest tests.test_cuda)
		[ -x "$b/bin/kvtransfer.test" ] && (cd kvtransfer && run "$b/bin/kvtransfer.test" -test.count=1 \
			-test.run 'GPU|CUDA|Staged|Staging|PerNode|LinkPath|HostGPU|CopyHost|EngineOwned')
	fi
	# GPU regions move on kvproxy's own CUDA path whatever the transport;
	# tcp is the fallback if the ucx kvproxy cannot start there.
	want same && for tr in ${KV_TRANSPORT:-ucx tcp}; do
		run python3 "$sc/kv_gpu_bench.py" --kvproxy "$b/bin/kvproxy" --transport "$tr" \
			--modes "${MODES:-auto,kernel,memcpy}" --out "$out/kv-gpu-transfers.json" && break
	done
	# Two host ids: each kvproxy takes the other for another host, so GPU
	# KV takes the staged path (gather, tcp, scatter) on this one machine.
	staged=(--modes "${STAGED_MODES:-auto}" --host-ids node-a,node-b --tokens "${STAGED_TOKENS:-128,4096,32768}"
		--patterns "${STAGED_PATTERNS:-contiguous,scattered,scattered-sglang}")
	want staged && run python3 "$sc/kv_gpu_bench.py" --kvproxy "$b/bin/kvproxy" --transport tcp "${staged[@]}" \
		--out "$out/kv-gpu-staged.json"
	# The same over ucx: each 1 MiB chunk by one put from the writer's
	# registered staging buffer into a slot of the receiver's ring. Without
	# an RDMA lane kvproxy would pick DATA frames (staged-tcp), UCX's tcp
	# puts being emulations: PDROUTER_STAGE_PUTS=1 asks for the puts.
	want staged-ucx && run env UCX_TLS=tcp PDROUTER_STAGE_PUTS=1 timeout 240 python3 "$sc/kv_gpu_bench.py" --kvproxy "$b/bin/kvproxy" --transport ucx "${staged[@]}" \
		--out "$out/kv-gpu-staged-ucx.json"
	if want ceilings; then
		# The wire under both: 64 MiB of host memory over our tcp link, and
		# the staged path's per-page cost on stand-in GPUs (CPU copies).
		[ -x "$b/bin/kvtransfer.test" ] && (cd kvtransfer && run "$b/bin/kvtransfer.test" -test.run XXX \
			-test.bench 'Staged(Write|Pages)/(host-tcp|tcp)' -test.benchtime 10x -test.count 3) | tee "$out/wire.txt"
		# Per-run message sizes: a page (32 KiB, scattered) and one buffer's
		# share of 128, 1k, 4k and 32k contiguous tokens.
		run ucxbench -role suite -mem cuda -runs "${RUNS:-3}" -tls 'cuda_copy,cuda_ipc,posix,cma,tcp' \
			-sizes 32768,262144,2097152,8388608,67108864 -json "$out/ucx-gpu.json" -md ''
		# UCX's own staging pipeline for CUDA memory over tcp.
		for size in 32768 262144 2097152 8388608; do
			perf_cuda_tcp "$size"
		done | tee "$out/ucx-cuda-tcp.txt"
		# The wire under UCX's staging: host memory over UCX's tcp.
		run ucxbench -role suite -mem host -runs "${RUNS:-3}" -tls tcp \
			-sizes 2097152,8388608,67108864 -json "$out/ucx-host-tcp.json" -md ''
		echo "== torch copies and the TCP loopback"
		python3 "$sc/gpu_copy_bench.py" 8388608,16777216,134217728,536870912,4294967296 >"$out/torch-copy.json"
		cat "$out/torch-copy.json"
	fi
	python3 - "$out" <<'PY'
import json, sys, os
o = sys.argv[1]
res = {}
for k, f in (("transfers", "kv-gpu-transfers.json"), ("staged", "kv-gpu-staged.json"), ("staged_ucx", "kv-gpu-staged-ucx.json"),
             ("ucx_perftest", "ucx-gpu.json"), ("ucx_host_tcp", "ucx-host-tcp.json"), ("torch_copy", "torch-copy.json")):
    p = os.path.join(o, f)
    res[k] = json.load(open(p)) if os.path.exists(p) and os.path.getsize(p) else None
for k, f in (("ucx_cuda_tcp", "ucx-cuda-tcp.txt"), ("wire", "wire.txt")):
    p = os.path.join(o, f)
    res[k] = open(p).read().splitlines() if os.path.exists(p) else None
json.dump(res, open(os.path.join(o, "kv-gpu.json"), "w"), indent=1)
# The rows: each staged run's path (from kvproxy's /status) and figures.
out = []
for k in ("transfers", "staged", "staged_ucx"):
    for run in (res[k] or {}).get("runs", []):
        paths = sorted({p["src"] + "->" + p["dst"] + ": " + (p.get("path") or p.get("error", ""))
                        for l in run["link_paths"].get("links", []) for p in l["paths"]})
        out.append("%s (transport %s, host ids %s): %s" % (k, run["transport"], run["host_ids"], "; ".join(paths)))
        for r in run["rows"]:
            out.append("  %-16s %6d tok %9.0f us %8.2f GB/s verified=%s" % (r["pattern"], r["tokens"], r["median_us"], r["gbps"], r["verified"]))
out += res["ucx_cuda_tcp"] or ["ucx_perftest cuda-over-tcp: no rows"]
out += [l for l in res["wire"] or [] if l.startswith("Benchmark")]
open(os.path.join(o, "summary.txt"), "w").write("\n".join(out) + "\n")
print("\n".join(out))
PY
} 2>&1 | tee "$out/bench-kv-gpu.log"
