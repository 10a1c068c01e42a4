#!/usr/bin/env bash
# scripts/bench-vllm.sh on the GPU machine (16 cores, Python 3.12; no Go, nginx, wrk, network or
# package index), from the repo root with bin/devbench carried (make devbench-bundle builds it):
# each router pinned to core ROUTER_CPU (0), the engines and pdbench on every other core except
# ROUTER_CPU's hyperthread siblings, so that the pinned rows' req/s is the routers' and not the
# engines'. Needs python3 and util-linux's taskset. Writes to $OUT (bench/out/devbench when unset):
#   vllm.md      bench-vllm's table            vllm.json  its rows, one a line (also when cut short)
#   vllm.log     its progress, round by round  machine.txt cores, siblings, load, versions
# Knobs: bench-vllm.sh's own, with defaults sized for the device's 10-minute call (N_REQ 10000,
# ROUNDS 5, LAT_ROUNDS 8, STREAMS 1000); BASE=pdrouter-base runs the bundle's pdrouter-base (make
# devbench-bundle BASE_REF=...) as bench-vllm's third router; BUNDLE (bin/devbench); LIMIT_S (480:
# bench-vllm is stopped then, its finished rows kept).
set -euo pipefail
cd "$(dirname "$0")/.."
bundle=${BUNDLE:-bin/devbench}
OUT=${OUT:-bench/out/devbench}
work=/tmp/devbench
[ -f "$bundle/tools.tar.xz" ] || { echo "devbench-run: $bundle/tools.tar.xz missing: run scripts/devbench-bundle.sh and carry $bundle" >&2; exit 1; }
command -v taskset >/dev/null || { echo "devbench-run: taskset missing (util-linux)" >&2; exit 1; }
mkdir -p "$OUT"
rm -rf "$work"
mkdir -p "$work"
t0=$SECONDS
python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="tar")' "$bundle/tools.tar.xz" "$work"
python3 -m pip install -q --no-index --no-deps --disable-pip-version-check --target "$work/site" "$bundle"/wheels/*.whl
# vllm-router's console script would name pip's Python; this names the one on PATH, and keeps
# the wheels' packages to vllm-router alone.
cat >"$work/bin/vllm-router" <<SH
#!/bin/sh
PYTHONPATH=$work/site exec $(command -v python3) -m vllm_router.launch_router "\$@"
SH
chmod +x "$work/bin/vllm-router"
"$work/bin/vllm-router" --help >/dev/null || { echo "devbench-run: vllm-router's launcher does not start" >&2; exit 1; }
export PATH=$work/bin:$PATH
echo "devbench-run: unpacked in $((SECONDS - t0)) s" >&2

# ROUTER_CPU's siblings share its core's execution units: the load stays off them.
ROUTER_CPU=${ROUTER_CPU:-0}
siblings=$(cat "/sys/devices/system/cpu/cpu$ROUTER_CPU/topology/thread_siblings_list" 2>/dev/null || echo "$ROUTER_CPU")
if [ -z "${LOAD_CPU:-}" ]; then
	LOAD_CPU=$(python3 - "$siblings" <<-'PY'
	import os, sys
	taken = set()
	for part in sys.argv[1].split(","):
	    lo, _, hi = part.partition("-")
	    taken.update(range(int(lo), int(hi or lo) + 1))
	runs = []  # the rest as a taskset list of ranges: 1-7,9-15
	for c in sorted(os.sched_getaffinity(0) - taken):
	    if runs and runs[-1][1] == c - 1:
	        runs[-1][1] = c
	    else:
	        runs.append([c, c])
	print(",".join(str(lo) if lo == hi else "%d-%d" % (lo, hi) for lo, hi in runs))
	PY
	)
fi
[ -n "$LOAD_CPU" ] || { echo "devbench-run: no core left for the load beside $siblings" >&2; exit 1; }
{
	echo "date: $(date -u +%FT%TZ)"
	echo "nproc: $(nproc); ROUTER_CPU=$ROUTER_CPU (siblings $siblings); LOAD_CPU=$LOAD_CPU"
	grep -m1 'model name' /proc/cpuinfo || true
	echo "load: $(cat /proc/loadavg)"
	echo "python: $(python3 -V 2>&1) at $(command -v python3)"
	echo "nginx: $(nginx -v 2>&1)"
	cat "$bundle/MANIFEST" 2>/dev/null || true
} >"$OUT/machine.txt"
cat "$OUT/machine.txt" >&2

base=${BASE:-}
[ "$base" != pdrouter-base ] || base=$work/bin/pdrouter-base
rc=0
rm -f bench/out/vllm.json
env BIN="$work/bin" VLLM_ROUTER="$work/bin/vllm-router" ROUTER_CPU="$ROUTER_CPU" LOAD_CPU="$LOAD_CPU" BASE="$base" \
	N_REQ="${N_REQ:-10000}" ROUNDS="${ROUNDS:-5}" LAT_ROUNDS="${LAT_ROUNDS:-8}" STREAMS="${STREAMS:-1000}" \
	timeout -k 30 "${LIMIT_S:-480}" scripts/bench-vllm.sh >"$OUT/vllm.md" 2> >(tee "$OUT/vllm.log" >&2) || rc=$?
cp bench/out/vllm.json "$OUT/vllm.json" 2>/dev/null || true
echo "load after: $(cat /proc/loadavg); $((SECONDS - t0)) s in all; bench-vllm exit $rc" >>"$OUT/machine.txt"
cat "$OUT/vllm.md"
exit "$rc"
