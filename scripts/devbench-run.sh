#!/usr/bin/env bash
# Benchmarks on the GPU machine (16 cores, Python 3.12 with numpy; no Go, nginx, wrk, network or
# package index), from the repo root with the bundles of scripts/devbench-bundle.sh carried. Needs
# python3 and util-linux's taskset. Writes to $OUT (bench/out/devbench when unset) machine.txt
# (cores, load, versions, timings) and, per mode (one or both, in the order given; default vllm):
#   vllm         bin/devbench carried: scripts/bench-vllm.sh with each router pinned to core
#                ROUTER_CPU (0) and the engines and pdbench on every other core but ROUTER_CPU's
#                hyperthread siblings, so that the pinned rows' req/s is the routers' and not the
#                engines'. vllm.md (the table), vllm.json (its rows, kept when cut short),
#                vllm.log (round by round). Knobs: bench-vllm.sh's own, with defaults sized for the
#                device's 10-minute call (N_REQ 10000, ROUNDS 5, LAT_ROUNDS 8, STREAMS 1000);
#                BASE=pdrouter-base runs the bundle's pdrouter-base (BASE_REF= of the bundle) as
#                the third router.
#   small-write  bin/devbench-kv carried: python/harness/small_write_ab.py, the tree's python/
#                with the bundle's kvproxy ("new") against Mooncake's TCP engine over tcp and shm
#                (that kvproxy has no ucx). small_write.txt, small_write.log. Knobs: SW_ROUNDS (9),
#                SW_CALLS (2000).
# Both bundles fit one call (check with du: 64 MiB with the working tree): `small-write vllm`;
# bench-vllm is stopped DEADLINE_S (540) seconds after this script's start, its finished rows kept.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -gt 0 ] || set -- vllm
for mode in "$@"; do
	case $mode in
	vllm) tar=bin/devbench/tools.tar.xz ;;
	small-write) tar=bin/devbench-kv/kv.tar.xz ;;
	*) echo "usage: $0 [vllm] [small-write]" >&2; exit 2 ;;
	esac
	[ -f "$tar" ] || { echo "devbench-run: $tar missing: build it with scripts/devbench-bundle.sh and carry its folder" >&2; exit 1; }
done
OUT=${OUT:-bench/out/devbench}
work=$PWD/bin/devbench-work # beside the repo, where binaries are known to run (/tmp may be noexec)
mkdir -p "$OUT"
rm -rf "$work"
mkdir -p "$work"
{
	echo "date: $(date -u +%FT%TZ); nproc: $(nproc); load: $(cat /proc/loadavg)"
	grep -m1 'model name' /proc/cpuinfo || true
	echo "python: $(python3 -V 2>&1) at $(command -v python3)"
} >"$OUT/machine.txt"
note() { echo "devbench-run: $*" | tee -a "$OUT/machine.txt" >&2; }
unpack() { # TAR
	python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="tar")' "$1" "$work"
	cat "$(dirname "$1")/MANIFEST" >>"$OUT/machine.txt"
}

small_write() {
	local rc=0
	unpack bin/devbench-kv/kv.tar.xz
	python3 python/harness/small_write_ab.py --rounds "${SW_ROUNDS:-9}" --calls "${SW_CALLS:-2000}" --transports tcp,shm \
		--mooncake-path "$work/mooncake" "new=$work/bin/kvproxy" >"$OUT/small_write.txt" 2>"$OUT/small_write.log" || rc=$?
	note "small-write done at $SECONDS s, exit $rc, load $(cat /proc/loadavg)"
	cat "$OUT/small_write.txt"
	[ "$rc" = 0 ] || tail -20 "$OUT/small_write.log" >&2
	return "$rc"
}

vllm() {
	local rc=0 siblings base left
	command -v taskset >/dev/null || { echo "devbench-run: taskset missing (util-linux)" >&2; return 1; }
	unpack bin/devbench/tools.tar.xz
	python3 -m pip install -q --no-index --no-deps --disable-pip-version-check --target "$work/site" bin/devbench/wheels/*.whl
	# vllm-router's console script would name pip's Python; this names the one on PATH, and keeps
	# the wheels' packages to vllm-router alone.
	cat >"$work/bin/vllm-router" <<-SH
	#!/bin/sh
	PYTHONPATH=$work/site exec $(command -v python3) -m vllm_router.launch_router "\$@"
	SH
	chmod +x "$work/bin/vllm-router"
	"$work/bin/vllm-router" --help >/dev/null || { echo "devbench-run: vllm-router's launcher does not start" >&2; return 1; }
	export PATH=$work/bin:$PATH

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
	[ -n "$LOAD_CPU" ] || { echo "devbench-run: no core left for the load beside $siblings" >&2; return 1; }
	note "vllm unpacked at $SECONDS s; ROUTER_CPU=$ROUTER_CPU (siblings $siblings), LOAD_CPU=$LOAD_CPU; $(nginx -v 2>&1)"

	base=${BASE:-}
	[ "$base" != pdrouter-base ] || base=$work/bin/pdrouter-base
	left=$((${DEADLINE_S:-540} - SECONDS))
	[ "$left" -ge 120 ] || { note "vllm: only $left s left of DEADLINE_S"; return 1; }
	rm -f bench/out/vllm.json
	env BIN="$work/bin" VLLM_ROUTER="$work/bin/vllm-router" ROUTER_CPU="$ROUTER_CPU" LOAD_CPU="$LOAD_CPU" BASE="$base" \
		N_REQ="${N_REQ:-10000}" ROUNDS="${ROUNDS:-5}" LAT_ROUNDS="${LAT_ROUNDS:-8}" STREAMS="${STREAMS:-1000}" \
		timeout -k 30 "$left" bash scripts/bench-vllm.sh >"$OUT/vllm.md" 2> >(tee "$OUT/vllm.log" >&2) || rc=$?
	cp bench/out/vllm.json "$OUT/vllm.json" 2>/dev/null || true
	note "vllm done at $SECONDS s, bench-vllm exit $rc$([ "$rc" != 124 ] || echo ' (stopped at DEADLINE_S)'), load $(cat /proc/loadavg)"
	cat "$OUT/vllm.md"
	# 124 would read as the device tool's own time limit
	[ "$rc" != 124 ] || rc=3
	return "$rc"
}

rc=0
for mode in "$@"; do
	"${mode//-/_}" || rc=$?
done
exit "$rc"
