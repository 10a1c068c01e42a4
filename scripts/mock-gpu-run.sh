#!/usr/bin/env bash
# The mock engine's KV in GPU memory (issue 27): build the CUDA bundle here
# (make cuda-bundle: kvproxy and mockworker against the bundle's UCX), then
# run THIS script on the GPU machine from the repo root (device tool, carry
# bin/cuda). A prefill and a decode mockworker with --kv-memory cuda:N
# (N=KV_GPU, default 0) register their KV pools by CUDA IPC handle with
# their kvproxies and move rooms of TOKENS (default 4096) tokens; the
# decode engine reads every page back from its GPU and checks it, so a
# request that returns proves the KV landed in device memory. The same
# run has a host-memory side as the baseline. Results in $OUT (or
# bench/out): mock-gpu.log, and the GPU engines' stderr in
# mock-gpu-engines.log.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench/out}
mkdir -p "$out"
out=$(cd "$out" && pwd)
b=${CUDA_BUNDLE:-$PWD/bin/cuda}
export LD_LIBRARY_PATH=$b/lib PATH=$b/bin:$PATH PYTHONUNBUFFERED=1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# A bin dir per side: the GPU side's mockworker asks for device memory.
mkdir -p "$work/host" "$work/gpu"
for d in host gpu; do ln -s "$b/bin/kvproxy" "$work/$d/kvproxy"; done
ln -s "$b/bin/mockworker" "$work/host/mockworker"
cat >"$work/gpu/mockworker" <<SH
#!/bin/sh
exec "$b/bin/mockworker" "\$@" --kv-memory cuda:${KV_GPU:-0} 2>>"$out/mock-gpu-engines.log"
SH
chmod +x "$work/gpu/mockworker"
{
	nvidia-smi -L
	echo "== rooms_ab: host memory against GPU memory, tcp and shm for the aux buffer"
	python3 python/harness/rooms_ab.py --tokens "${TOKENS:-4096}" --rounds "${ROUNDS:-5}" \
		host-shm="$work/host:shm" gpu-shm="$work/gpu:shm" gpu-tcp="$work/gpu:tcp"
	echo "rc=$?"
} 2>&1 | tee "$out/mock-gpu.log"
