#!/usr/bin/env bash
# make bench-kv-gpu: builds the CUDA bundle here (make cuda-bundle), then run
# THIS script on the GPU machine from the repo root (device tool, carry
# bin/cuda): GPU unit tests, the KV transfer benchmark between two engine
# processes through their kvproxies (scripts/kv_gpu_bench.py), and in the
# same call ucx_perftest -m cuda,cuda (with ucxbench) at the per-run message
# sizes and torch device copies of the same totals. Results in $OUT (or
# bench/out): kv-gpu.json (everything), bench-kv-gpu.log.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench/out}
mkdir -p "$out"
b=$PWD/bin/cuda
export PYTHONPATH=$PWD/python LD_LIBRARY_PATH=$b/lib PATH=$b/bin:$PATH PYTHONUNBUFFERED=1
run() { echo "== $*"; "$@"; local rc=$?; echo "rc=$rc"; return $rc; }
{
	nvidia-smi -L
	(cd internal/cuda && run "$b/bin/cuda.test" -test.v -test.count=1)
	(cd ucx && run "$b/bin/ucx.test" -test.v -test.count=1 -test.run 'CUDA|MapAddr')
	(cd python && run python3 -m unittest tests.test_cuda)
	# GPU regions move on kvproxy's own CUDA path whatever the transport;
	# tcp is the fallback if the ucx kvproxy cannot start there.
	for tr in ${KV_TRANSPORT:-ucx tcp}; do
		run python3 scripts/kv_gpu_bench.py --kvproxy "$b/bin/kvproxy" --transport "$tr" \
			--modes "${MODES:-auto,kernel,memcpy}" --out "$out/kv-gpu-transfers.json" && break
	done
	# Per-run message sizes: a page (32 KiB, scattered) and one buffer's
	# share of 128, 1k, 4k and 32k contiguous tokens.
	run ucxbench -role suite -mem cuda -runs "${RUNS:-3}" -tls 'cuda_copy,cuda_ipc,posix,cma,tcp' \
		-sizes 32768,262144,2097152,8388608,67108864 -json "$out/ucx-gpu.json" -md ''
	echo "== torch device copies"
	python3 scripts/gpu_copy_bench.py 16777216,134217728,536870912,4294967296 >"$out/torch-copy.json"
	cat "$out/torch-copy.json"
	python3 - "$out" <<'PY'
import json, sys, os
o = sys.argv[1]
res = {}
for k, f in (("transfers", "kv-gpu-transfers.json"), ("ucx_perftest", "ucx-gpu.json"), ("torch_copy", "torch-copy.json")):
    p = os.path.join(o, f)
    res[k] = json.load(open(p)) if os.path.exists(p) and os.path.getsize(p) else None
json.dump(res, open(os.path.join(o, "kv-gpu.json"), "w"), indent=1)
PY
} 2>&1 | tee "$out/bench-kv-gpu.log"
