#!/usr/bin/env bash
# bench-streams: memory and descriptors per open stream, two pdrouter builds side by side in one
# run (an A/B of a change to what a stream holds). For each stream count, each build gets a fresh
# PD 1P+1D router on the same mockworkers, the runs alternating between the builds; while the
# streams are open a sampler reads the router's RSS and open descriptors.
#
#   scripts/bench-streams.sh OLD_PDROUTER NEW_PDROUTER
#
# Knobs (environment): BIN (bin: mockworker, pdbench); COUNTS ("1000 N", N the most streams the
# hard open-file limit holds through pdrouter's default --max-connections, in hundreds: 6500 at
# 20,000, three descriptors a PD client); RATE for each count above 1000 (2000/s; 1000 and fewer open at once); TOKENS (256) per
# stream; TOKEN_DELAY (10ms for 1000 and fewer, BIG_TOKEN_DELAY 40ms above, so that all are open
# together); above 1000 the first token comes after FIRST_TOKEN (twice the largest count's
# arrivals + 5 s; as in bench-router.sh, so that the decode worker is not generating while they
# arrive) and each stream may take TIMEOUT (300s); ROUNDS (1); WORKER_FLAGS, given to every
# mockworker (--enable-http2: they serve h2c too, for a NEW_PDROUTER run with --upstream-http2,
# e.g. a script that execs pdrouter --upstream-http2 "$@"); PROFILE, a folder: routers built with
# -tags pprof leave there, a third of the way into the largest count's token phase, a heap profile
# and a goroutine dump (NAME-N.heap, NAME-N.goroutines).
# Prints one line per run; per-stream figures are (peak − idle) / peak open streams.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# = 2 ] || { echo "usage: $0 OLD_PDROUTER NEW_PDROUTER" >&2; exit 2; }
OLD=$1 NEW=$2
BIN=${BIN:-bin}
ulimit -n "$(ulimit -Hn)"
FD_LIMIT=$(ulimit -n)
FD_RESERVE=$((FD_LIMIT / 64 < 64 ? 64 : FD_LIMIT / 64 > 4096 ? 4096 : FD_LIMIT / 64))
COUNTS=${COUNTS:-1000 $(((FD_LIMIT - FD_RESERVE) / 3 / 100 * 100))}
RATE=${RATE:-2000}
TOKENS=${TOKENS:-256}
TOKEN_DELAY=${TOKEN_DELAY:-10ms}
BIG_TOKEN_DELAY=${BIG_TOKEN_DELAY:-40ms}
ROUNDS=${ROUNDS:-1}
TIMEOUT=${TIMEOUT:-300s}
largest=$(printf '%s\n' $COUNTS | sort -n | tail -n1)
FIRST_TOKEN=${FIRST_TOKEN:-$((2 * largest / RATE + 5))s}
. scripts/bench-lib.sh
bench_setup bench-streams

worker() { # VAR ROLE [flags]
	local var=$1 role=$2 port
	shift 2
	port=$(free_port)
	"$BIN/mockworker" --role "$role" --port "$port" --record-requests -1 ${WORKER_FLAGS:-} "$@" >"$T/mw-$port.log" 2>&1 &
	pids+=($!)
	until http_ok "$port" /health; do sleep 0.1; done
	printf -v "$var" %s "$port"
}
worker P prefill --tokens "$TOKENS" --token-delay 0
worker D decode --tokens "$TOKENS" --token-delay "$TOKEN_DELAY"
worker DB decode --tokens "$TOKENS" --token-delay "$BIG_TOKEN_DELAY" --prefill-delay "$FIRST_TOKEN"

# sample PID FILE: every 0.1 s, "rss_kib fds" of PID until it exits or the file's run ends.
sample() {
	while kill -0 "$1" 2>/dev/null && [ ! -e "$2.stop" ]; do
		echo "$(awk '/^VmRSS/ {print $2}' "/proc/$1/status" 2>/dev/null) $(ls "/proc/$1/fd" 2>/dev/null | wc -l)" >>"$2"
		sleep 0.1
	done
}

# profile NAME PORT SECONDS: the router's heap profile and goroutine dump SECONDS from now.
profile() {
	mkdir -p "$PROFILE"
	sleep "$3"
	curl -sf "http://127.0.0.1:$2/debug/pprof/heap" -o "$PROFILE/$1.heap" || log "no heap profile from $1"
	curl -sf "http://127.0.0.1:$2/debug/pprof/goroutine?debug=1" -o "$PROFILE/$1.goroutines" || log "no goroutine dump from $1"
}

# run NAME BINARY N: N streams through a fresh router built from BINARY.
run() {
	local name=$1 bin=$2 n=$3 port prom pprof pid dec rate idle_rss idle_fds warm=1 timeout=120s
	port=$(free_port) prom=$(free_port) pprof=$(free_port)
	dec=$D rate=inf
	if ((n > 1000)); then dec=$DB rate=$RATE warm=0 timeout=$TIMEOUT; fi
	PDROUTER_PPROF=127.0.0.1:$pprof "$bin" --host 127.0.0.1 --port "$port" --prometheus-port "$prom" --policy round_robin --log-level warn \
		--pd-disaggregation --prefill "http://127.0.0.1:$P" 8998 --decode "http://127.0.0.1:$dec" >"$T/router-$name-$n.log" 2>&1 &
	pid=$!
	pids+=("$pid")
	until http_ok "$port" /readiness; do sleep 0.1; done
	idle_rss=$(awk '/^VmRSS/ {print $2}' "/proc/$pid/status")
	idle_fds=$(ls "/proc/$pid/fd" | wc -l)
	local s="$T/sample-$name-$n"
	rm -f "$s" "$s.stop"
	sample "$pid" "$s" &
	local sampler=$!
	local profiler=
	if [ -n "${PROFILE:-}" ] && ((n == largest)); then
		profile "$name-$n" "$pprof" $((${FIRST_TOKEN%s} + TOKENS * ${BIG_TOKEN_DELAY%ms} / 3000)) &
		profiler=$!
	fi
	"$BIN/pdbench" --backend openai-chat --base-url "http://127.0.0.1:$port" --model mock --random-input-len 32 \
		--random-output-len "$TOKENS" --random-range-ratio 1 --num-prompts "$n" --max-concurrency "$n" \
		--warmup-requests "$warm" --request-rate "$rate" --request-timeout "$timeout" --output-file "$T/pdbench-$name-$n.jsonl" >"$T/pdbench-$name-$n.txt" 2>&1 || true
	touch "$s.stop"
	wait "$sampler" || true
	[ -z "$profiler" ] || wait "$profiler" || true
	local hwm peak_fds done failed open cpu
	hwm=$(awk '/^VmHWM/ {print $2}' "/proc/$pid/status")
	cpu=$(awk -v hz="$(getconf CLK_TCK)" '{print ($14 + $15) / hz}' "/proc/$pid/stat")
	peak_fds=$(awk 'BEGIN {m = 0} $2 > m {m = $2} END {print m}' "$s")
	done=$(tail -n1 "$T/pdbench-$name-$n.jsonl" | grep -o '"completed":[0-9]*' | cut -d: -f2)
	failed=$(tail -n1 "$T/pdbench-$name-$n.jsonl" | grep -o '"failed":[0-9]*' | cut -d: -f2)
	open=$(tail -n1 "$T/pdbench-$name-$n.jsonl" | grep -o '"peak_concurrency":[0-9]*' | cut -d: -f2)
	kill "$pid"
	wait "$pid" 2>/dev/null || true
	if [ "${failed:-1}" != 0 ]; then # what failed, most frequent first (for the log, not the table)
		sed -n 's/.*"errors":\[\([^]]*\)\].*/\1/p' "$T/pdbench-$name-$n.jsonl" | tr ',' '\n' | grep -v '^""$' |
			sort | uniq -c | sort -rn | head -n3 | while read -r line; do log "$name $n: $line"; done || true # none listed: not a reason to stop
	fi
	awk -v name="$name" -v n="$n" -v done="${done:-0}" -v failed="${failed:-$n}" -v open="${open:-0}" \
		-v ir="$idle_rss" -v hr="$hwm" -v ifd="$idle_fds" -v pf="$peak_fds" -v cpu="$cpu" 'BEGIN {
		o = open > 0 ? open : 1
		printf "%-4s streams %5d  completed %5d failed %5d peak open %5d  idle RSS %6.1f MiB  peak RSS %6.1f MiB  %5.1f KiB/stream  peak fds %5d  %.2f fds/stream  CPU %.1f s\n",
			name, n, done, failed, open, ir / 1024, hr / 1024, (hr - ir) / o, pf, (pf - ifd) / o, cpu
	}'
}

for n in $COUNTS; do
	for ((round = 1; round <= ROUNDS; round++)); do
		if ((round % 2)); then run old "$OLD" "$n"; run new "$NEW" "$n"; else run new "$NEW" "$n"; run old "$OLD" "$n"; fi
	done
done
