#!/usr/bin/env bash
# make bench-nixl-gpu: builds bin/cuda (kvproxy with CUDA) and bin/nixl
# (PyPI's NIXL, trimmed) here; run THIS script on the GPU machine from the
# repo root, carrying bin/cuda/bin/kvproxy, bin/cuda/lib and bin/nixl: GPU KV
# through the NIXL API on one GPU, NIXL 1.5.1 (UCX 1.23) against python/nixl
# over kvproxy, the same SGLang-shaped calls (scripts/nixl_gpu_bench.py), and
# in the same call torch's device-to-device copy of the same bytes (the
# ceiling, and what normalises figures across calls).
#
# ROUNDS rounds (default 3) of each library, alternating (kvproxy first in
# odd rounds, NIXL first in even ones), each a fresh pair of processes with
# its own warm-up; the figures pool every round, and each ratio is also given
# as the median of the rounds' paired ratios. Every other page runs in the
# first round only (NIXL takes 2 s a transfer at 32k tokens so; contiguous
# pages are where the two are close). KVPROXY_COPY_MODES (default "auto")
# adds kvproxy rounds with its GPU copy forced, e.g. "auto memcpy".
# TOKENS (default 4096,32768), REPS (timed posts a case and round, default 20).
# Results in $OUT (or bench/out): nixl-gpu.json (pooled, and every round),
# nixl-gpu-LIBRARY-ROUND.json, nixl-gpu-torch.json, bench-nixl-gpu.log.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench/out}
mkdir -p "$out"
b=${CUDA_BUNDLE:-$PWD/bin/cuda}
export PYTHONPATH=$PWD/python LD_LIBRARY_PATH=$b/lib PYTHONUNBUFFERED=1
tokens=${TOKENS:-4096,32768}
rounds=${ROUNDS:-3}
reps=${REPS:-20}
modes=${KVPROXY_COPY_MODES:-auto}
{
	nvidia-smi -L
	rc=0
	rm -f "$out"/nixl-gpu-*.json
	run_kvproxy() {
		for mode in $modes; do
			local label=kvproxy
			[ "$mode" = auto ] || label=kvproxy-$mode
			python3 scripts/nixl_gpu_bench.py --impl kvproxy --kvproxy "$b/bin/kvproxy" --copy-mode "$mode" --tokens "$tokens" \
				--patterns "$2" --reps "$reps" --round "$1" --out "$out/nixl-gpu-$label-$1.json" || rc=1
		done
	}
	# NIXL brings its own UCX: keep the bundle's off its library path.
	run_nixl() {
		LD_LIBRARY_PATH= python3 scripts/nixl_gpu_bench.py --impl nixl --nixl-path bin/nixl --tokens "$tokens" \
			--patterns "$2" --reps "$reps" --round "$1" --out "$out/nixl-gpu-nixl-$1.json" || rc=1
	}
	for r in $(seq 1 "$rounds"); do
		pats=contiguous
		[ "$r" -eq 1 ] && pats=contiguous,scattered
		if [ $((r % 2)) -eq 1 ]; then run_kvproxy "$r" "$pats"; run_nixl "$r" "$pats"; else run_nixl "$r" "$pats"; run_kvproxy "$r" "$pats"; fi
	done
	python3 scripts/gpu_copy_bench.py 536870912,4294967296 >"$out/nixl-gpu-torch.json" || rc=1
	cat "$out/nixl-gpu-torch.json"
	python3 scripts/nixl_gpu_bench.py --summary "$out" || rc=1
	exit $rc
} 2>&1 | tee "$out/bench-nixl-gpu.log"
