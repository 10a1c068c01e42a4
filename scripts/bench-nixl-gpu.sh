#!/usr/bin/env bash
# make bench-nixl-gpu: builds bin/cuda (kvproxy with CUDA) and bin/nixl
# (PyPI's NIXL, trimmed) here; run THIS script on the GPU machine from the
# repo root, carrying bin/cuda/bin/kvproxy, bin/cuda/lib and bin/nixl: GPU KV
# through the NIXL API on one GPU, NIXL 1.5.1 (UCX 1.23) against python/nixl
# over kvproxy, the same SGLang-shaped calls (scripts/nixl_gpu_bench.py), and
# in the same call torch's device-to-device copy of the same bytes (the
# ceiling, and what normalises figures across calls). Results in $OUT (or
# bench/out): nixl-gpu.json, bench-nixl-gpu.log.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench/out}
mkdir -p "$out"
b=${CUDA_BUNDLE:-$PWD/bin/cuda}
export PYTHONPATH=$PWD/python LD_LIBRARY_PATH=$b/lib PYTHONUNBUFFERED=1
tokens=${TOKENS:-4096,32768}
{
	nvidia-smi -L
	rc=0
	python3 scripts/nixl_gpu_bench.py --impl kvproxy --kvproxy "$b/bin/kvproxy" --tokens "$tokens" --out "$out/nixl-gpu-kvproxy.json" || rc=1
	# NIXL brings its own UCX: keep the bundle's off its library path.
	LD_LIBRARY_PATH= python3 scripts/nixl_gpu_bench.py --impl nixl --nixl-path bin/nixl --tokens "$tokens" --out "$out/nixl-gpu-nixl.json" || rc=1
	python3 scripts/gpu_copy_bench.py 536870912,4294967296 >"$out/nixl-gpu-torch.json" || rc=1
	cat "$out/nixl-gpu-torch.json"
	python3 - "$out" <<'PY'
import json, os, sys
o = sys.argv[1]
res = {k: json.load(open(os.path.join(o, f))) for k, f in (("kvproxy", "nixl-gpu-kvproxy.json"), ("nixl", "nixl-gpu-nixl.json"),
                                                            ("torch_copy", "nixl-gpu-torch.json")) if os.path.exists(os.path.join(o, f))}
json.dump(res, open(os.path.join(o, "nixl-gpu.json"), "w"), indent=1)
if "kvproxy" in res and "nixl" in res:
    n = {(r["pattern"], r["tokens"]): r for r in res["nixl"]["rows"]}
    for r in res["kvproxy"]["rows"]:
        m = n.get((r["pattern"], r["tokens"]))
        if m:
            print("%-10s %6d tok  kvproxy %7.1f GB/s  NIXL %7.1f GB/s  ratio %.2f  post %0.f us vs %0.f us" % (
                r["pattern"], r["tokens"], r["gbps"], m["gbps"], r["gbps"] / m["gbps"], r["post_median_us"], m["post_median_us"]))
PY
	exit $rc
} 2>&1 | tee "$out/bench-nixl-gpu.log"
