#!/usr/bin/env bash
# Where pdrouter's CPU goes: a pdrouter built with -tags pprof (cmd/pdrouter/pprof.go) runs in
# regular mode and in PD 1P+1D on zero-delay workers, and a CPU profile is taken from it while
# `wrk -t1 -c64` posts non-streamed 8-token /generate requests. Writes the profiles to
# bench/out/pprof-{regular,pd}.pb.gz and their top costs to the router-profile section of
# bench/RESULTS.md. Knobs: BIN (bin, for the workers), PROFILE_SECS (8), WORKER (stubengine, whose
# fixed replies leave the cores to the router; mockworker, SGLang's behaviour in more detail).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-bin}
GO=${GO:-go}
PROFILE_SECS=${PROFILE_SECS:-8}
WORKER=${WORKER:-stubengine}
OUT=bench/out
command -v wrk >/dev/null || { echo "bench-profile: wrk missing; run scripts/install-deps.sh bench" >&2; exit 1; }
mkdir -p "$OUT"
. scripts/bench-lib.sh
bench_setup bench-profile
check_worker

wait_ok() { # PORT PATH LOG
	for _ in $(seq 300); do http_ok "$1" "$2" && return 0; sleep 0.1; done
	log ":$1 never answered $2; its log:"
	tail -n 20 "$3" >&2
	exit 1
}

log "building pdrouter with -tags pprof"
CGO_ENABLED=0 $GO build -tags pprof -o "$T/pdrouter-pprof" ./cmd/pdrouter

start_wrk_worker W regular
start_wrk_worker P prefill
start_wrk_worker D decode

# profile NAME ARGS...: one router, wrk against it, a CPU profile of PROFILE_SECS taken meanwhile.
profile() {
	local name=$1 port prom pp
	shift
	port=$(free_port) prom=$(free_port) pp=$(free_port)
	PDROUTER_PPROF=127.0.0.1:$pp "$T/pdrouter-pprof" --host 127.0.0.1 --port "$port" --prometheus-port "$prom" \
		--policy round_robin --log-level warn "$@" >"$T/router-$name.log" 2>&1 &
	local pid=$!
	pids+=("$pid")
	wait_ok "$port" /readiness "$T/router-$name.log"
	cat >"$T/post.lua" <<-'EOF'
		wrk.method = "POST"
		wrk.headers["Content-Type"] = "application/json"
		wrk.body = '{"text":"the quick brown fox jumps over the lazy dog","sampling_params":{"max_new_tokens":8},"stream":false}'
	EOF
	wrk -t1 -c64 -d"$((PROFILE_SECS + 3))s" -s "$T/post.lua" "http://127.0.0.1:$port/generate" >"$T/wrk-$name.txt" &
	local wrk_pid=$!
	sleep 1
	$GO tool pprof -proto -seconds "$PROFILE_SECS" -output "$OUT/pprof-$name.pb.gz" \
		"http://127.0.0.1:$pp/debug/pprof/profile" 2>"$T/pprof-$name.err" ||
		{ cat "$T/pprof-$name.err" >&2; exit 1; }
	wait "$wrk_pid"
	kill "$pid"
	log "$name: $(awk '/^Requests\/sec/ {printf "%.0f req/s", $2}' "$T/wrk-$name.txt")"
}
LOAD_START=$(cut -d' ' -f1 /proc/loadavg)
profile regular --worker-urls "http://127.0.0.1:$W"
profile pd --pd-disaggregation --prefill "http://127.0.0.1:$P" 8998 --decode "http://127.0.0.1:$D"
LOAD_END=$(cut -d' ' -f1 /proc/loadavg)

# top NAME: the profile's costliest functions, flat and cumulative, as markdown tables.
top() {
	$GO tool pprof -top -nodecount=40 "$OUT/pprof-$1.pb.gz" 2>/dev/null |
		awk '/^ *flat/ {go = 1; next} go && NF >= 6 {
			name = $6; for (i = 7; i <= NF; i++) name = name " " $i
			printf "| %s | %s | %s | `%s` |\n", $2, $5, $3, name
			if (++n == 20) exit }'
}
# cum NAME PATTERN: cumulative shares of the functions whose names match, costliest first.
cum() {
	$GO tool pprof -top -cum -nodecount=400 "$OUT/pprof-$1.pb.gz" 2>/dev/null |
		awk -v pat="$2" '/^ *flat/ {go = 1; next} go && NF >= 6 && $6 ~ pat {
			printf "| %s | `%s` |\n", $5, $6
			if (++n == 14) exit }'
}
SECTION=$(
	cat <<EOF
Run $(date -u '+%Y-%m-%d %H:%M') UTC on $(nproc) cores (1-minute load average $LOAD_START at the start, $LOAD_END at the end),
\`scripts/bench-profile.sh\`: pdrouter built with \`-tags pprof\`, $PROFILE_SECS s CPU profiles under \`wrk -t1 -c64\`
(non-streamed 8-token \`/generate\`, zero-delay ${WORKER}s): regular $(awk '/^Requests\/sec/ {printf "%.0f", $2}' "$T/wrk-regular.txt") req/s,
PD 1P+1D $(awk '/^Requests\/sec/ {printf "%.0f", $2}' "$T/wrk-pd.txt") req/s. Profiles: bench/out/pprof-{regular,pd}.pb.gz.

Regular, top functions by own time (flat %, cumulative %):

| flat % | cum % | sum % | function |
| ---: | ---: | ---: | --- |
$(top regular)

PD 1P+1D, top functions by own time:

| flat % | cum % | sum % | function |
| ---: | ---: | ---: | --- |
$(top pd)

PD 1P+1D, cumulative share of the router's own code and of the runtime's big items:

| cum % | function |
| ---: | --- |
$(cum pd '^(github.com/pdrouter|runtime\.(gcBgMarkWorker|mallocgc|findRunnable|schedule)$|internal/runtime/syscall|syscall\.)')
EOF
)
printf '%s\n' "$SECTION" >"$T/section.md"
if ! grep -q '<!-- BEGIN router-profile -->' bench/RESULTS.md; then
	printf '\n## Where pdrouter'"'"'s CPU goes (`scripts/bench-profile.sh`)\n<!-- BEGIN router-profile -->\n<!-- END router-profile -->\n' >>bench/RESULTS.md
fi
awk -v section="$T/section.md" '
	/<!-- BEGIN router-profile -->/ {print; while ((getline line <section) > 0) print line; skip = 1; next}
	/<!-- END router-profile -->/ {skip = 0}
	!skip {print}
' bench/RESULTS.md >"$T/RESULTS.md"
cp "$T/RESULTS.md" bench/RESULTS.md
echo "$SECTION"
