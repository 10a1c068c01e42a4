#!/usr/bin/env bash
# Runs on the GPU machine (device tool) from the repo root after make
# cuda-bundle here: checks the bundle (UCX's CUDA transports, the driver
# loader, IPC-opened memory registered with UCX across processes, the
# Python CUDA pointer module) and measures ucxbench -mem cuda against
# ucx_perftest -m cuda,cuda and a torch device copy. Results under $OUT.
set -uo pipefail
out=${OUT:-bench/out}
mkdir -p "$out"
b=bin/cuda
run() { echo "== $*"; "$@"; echo "rc=$?"; }
{
	run nvidia-smi -L
	run $b/env.sh ucx_info -v
	$b/env.sh ucx_info -d | grep -E 'Transport|Memory domain' | sort | uniq -c
	(cd internal/cuda && run ../../$b/bin/cuda.test -test.v -test.count=1)
	(cd ucx && run ../$b/bin/ucx.test -test.v -test.count=1 -test.run 'CUDA|MapAddr|APIVersion')
	(cd python && run python3 -m unittest -v tests.test_cuda)
	run python3 scripts/gpu_copy_bench.py >"$out/torch-copy.json"
	cat "$out/torch-copy.json"
	run $b/env.sh ucxbench -role suite -mem cuda -runs "${RUNS:-3}" -tls 'cuda_copy,cuda_ipc,posix,cma,tcp' \
		-json "$out/ucx-gpu.json" -md ''
	cat "$out/ucx-gpu.json"
} 2>&1 | tee "$out/gpu-check.log"
