#!/usr/bin/env bash
# make bench-kv-gpu: builds the CUDA bundle here (make cuda-bundle), then run
# THIS script on the GPU machine from the repo root (device tool, carry
# bin/cuda): GPU unit tests, the KV transfer benchmark between two engine
# processes through their kvproxies (scripts/kv_gpu_bench.py) on the
# same-host path and, with two host ids, on the staged cross-host path over
# tcp, and in the same call the ceilings: ucx_perftest -m cuda,cuda (with
# ucxbench) at the per-run message sizes over cuda_ipc and over
# tcp,cuda_copy (UCX's own staging), host memory over UCX's tcp, torch
# device, pinned device-to-host and host-to-device copies, and a TCP
# loopback socket. Results in $OUT (or bench/out): kv-gpu.json
# (everything), bench-kv-gpu.log. KV_SCRIPTS (default scripts) is where the
# Python benchmarks are.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench/out}
mkdir -p "$out"
b=${CUDA_BUNDLE:-$PWD/bin/cuda}
sc=${KV_SCRIPTS:-scripts}
export PYTHONPATH=$PWD/python LD_LIBRARY_PATH=$b/lib PATH=$b/bin:$PATH PYTHONUNBUFFERED=1
run() { echo "== $*"; "$@"; local rc=$?; echo "rc=$rc"; return $rc; }
{
	nvidia-smi -L
	(cd cuda && run "$b/bin/cuda.test" -test.v -test.count=1)
	(cd ucx && run "$b/bin/ucx.test" -test.v -test.count=1 -test.run 'CUDA|MapAddr')
	(cd python && run python3 -m unittest tests.test_cuda)
	# GPU regions move on kvproxy's own CUDA path whatever the transport;
	# tcp is the fallback if the ucx kvproxy cannot start there.
	for tr in ${KV_TRANSPORT:-ucx tcp}; do
		run python3 "$sc/kv_gpu_bench.py" --kvproxy "$b/bin/kvproxy" --transport "$tr" \
			--modes "${MODES:-auto,kernel,memcpy}" --out "$out/kv-gpu-transfers.json" && break
	done
	# Two host ids: each kvproxy takes the other for another host, so GPU
	# KV takes the staged path (gather, tcp, scatter) on this one machine.
	run python3 "$sc/kv_gpu_bench.py" --kvproxy "$b/bin/kvproxy" --transport tcp --host-ids node-a,node-b \
		--modes auto --out "$out/kv-gpu-staged.json"
	# Per-run message sizes: a page (32 KiB, scattered) and one buffer's
	# share of 128, 1k, 4k and 32k contiguous tokens.
	run ucxbench -role suite -mem cuda -runs "${RUNS:-3}" -tls 'cuda_copy,cuda_ipc,posix,cma,tcp|tcp,cuda_copy' \
		-sizes 32768,262144,2097152,8388608,67108864 -json "$out/ucx-gpu.json" -md ''
	# The wire under UCX's staging: host memory over UCX's tcp.
	run ucxbench -role suite -mem host -runs "${RUNS:-3}" -tls tcp \
		-sizes 2097152,8388608,67108864 -json "$out/ucx-host-tcp.json" -md ''
	echo "== torch copies and the TCP loopback"
	python3 "$sc/gpu_copy_bench.py" 8388608,16777216,134217728,536870912,4294967296 >"$out/torch-copy.json"
	cat "$out/torch-copy.json"
	python3 - "$out" <<'PY'
import json, sys, os
o = sys.argv[1]
res = {}
for k, f in (("transfers", "kv-gpu-transfers.json"), ("staged", "kv-gpu-staged.json"), ("ucx_perftest", "ucx-gpu.json"),
             ("ucx_host_tcp", "ucx-host-tcp.json"), ("torch_copy", "torch-copy.json")):
    p = os.path.join(o, f)
    res[k] = json.load(open(p)) if os.path.exists(p) and os.path.getsize(p) else None
json.dump(res, open(os.path.join(o, "kv-gpu.json"), "w"), indent=1)
PY
} 2>&1 | tee "$out/bench-kv-gpu.log"
