#!/usr/bin/env bash
# Benchmarks on the GPU machine (16 cores, Python 3.12 with numpy; no Go, nginx, wrk, network or
# package index), from the repo root with a bundle of scripts/devbench-bundle.sh carried. Needs
# python3 and util-linux's taskset. Writes to $OUT (bench/out/devbench when unset), machine.txt
# (cores, load, versions) and:
#   scripts/devbench-run.sh [vllm]   bin/devbench carried: scripts/bench-vllm.sh, each router pinned
#     to core ROUTER_CPU (0), the engines and pdbench on every other core but ROUTER_CPU's
#     hyperthread siblings, so that the pinned rows' req/s is the routers' and not the engines'.
#     vllm.md (the table), vllm.json (its rows, also when cut short), vllm.log (round by round).
#     Knobs: bench-vllm.sh's own, with defaults sized for the device's 10-minute call (N_REQ 10000,
#     ROUNDS 5, LAT_ROUNDS 8, STREAMS 1000); BASE=pdrouter-base runs the bundle's pdrouter-base
#     (BASE_REF= of the bundle) as the third router; LIMIT_S (480: bench-vllm is stopped then).
#   scripts/devbench-run.sh small-write   bin/devbench-kv carried: python/harness/small_write_ab.py,
#     the tree's python/ and the bundle's kvproxy ("new") against Mooncake's TCP engine, over tcp
#     and shm (the bundle's kvproxy has no ucx). small_write.txt (its result), small_write.log.
#     Knobs: ROUNDS (9), CALLS (2000).
# BUNDLE overrides the bundle's folder.
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-vllm}
case $what in
vllm) bundle=${BUNDLE:-bin/devbench} tar=tools.tar.xz ;;
small-write) bundle=${BUNDLE:-bin/devbench-kv} tar=kv.tar.xz ;;
*) echo "usage: $0 [vllm|small-write]" >&2; exit 2 ;;
esac
OUT=${OUT:-bench/out/devbench}
work=/tmp/devbench
[ -f "$bundle/$tar" ] || { echo "devbench-run: $bundle/$tar missing: build it with scripts/devbench-bundle.sh and carry $bundle" >&2; exit 1; }
mkdir -p "$OUT"
rm -rf "$work"
mkdir -p "$work"
t0=$SECONDS
python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="tar")' "$bundle/$tar" "$work"
machine() {
	echo "date: $(date -u +%FT%TZ); nproc: $(nproc); load: $(cat /proc/loadavg)"
	grep -m1 'model name' /proc/cpuinfo || true
	echo "python: $(python3 -V 2>&1) at $(command -v python3)"
	cat "$bundle/MANIFEST" 2>/dev/null || true
}

if [ "$what" = small-write ]; then
	machine >"$OUT/machine.txt"
	rc=0
	python3 python/harness/small_write_ab.py --rounds "${ROUNDS:-9}" --calls "${CALLS:-2000}" --transports tcp,shm \
		--mooncake-path "$work/mooncake" "new=$work/bin/kvproxy" >"$OUT/small_write.txt" 2>"$OUT/small_write.log" || rc=$?
	echo "load after: $(cat /proc/loadavg); $((SECONDS - t0)) s in all; small_write_ab exit $rc" >>"$OUT/machine.txt"
	cat "$OUT/small_write.txt"
	[ "$rc" = 0 ] || tail -20 "$OUT/small_write.log" >&2
	exit "$rc"
fi

command -v taskset >/dev/null || { echo "devbench-run: taskset missing (util-linux)" >&2; exit 1; }
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
	machine
	echo "ROUTER_CPU=$ROUTER_CPU (siblings $siblings); LOAD_CPU=$LOAD_CPU"
	echo "nginx: $(nginx -v 2>&1)"
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
