#!/usr/bin/env bash
# bench-ttft-ab: streamed TTFT of pdrouter builds beside direct, nginx and fastproxy in one run, for
# the A/B of a change to the stream path. Regular mode on one zero-delay stubengine; pdbench sends
# Poisson arrivals of streamed 8-token /generate requests to each target in turn, ROUNDS times (the
# order reversed every other round), so that load from elsewhere hits all targets alike. Prints per
# target the median over rounds of its p50 TTFT added over direct's in the same round, and, for
# each build, the median of its per-round difference from nginx's; an A/A pair (one binary under
# two names) shows the noise of the run.
#
#   scripts/bench-ttft-ab.sh NAME=PDROUTER_BINARY...
#
# Knobs (environment): BIN (bin); RATE (800 req/s); SECS (3) per target per round; ROUNDS (8).
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: $0 NAME=BINARY..." >&2; exit 2; }
BIN=${BIN:-bin}
RATE=${RATE:-800}
SECS=${SECS:-3}
ROUNDS=${ROUNDS:-8}
. scripts/bench-lib.sh
bench_setup bench-ttft-ab
command -v nginx >/dev/null || { log "needs nginx (scripts/install-deps.sh)"; exit 1; }

W=$(free_port)
"$BIN/stubengine" --role regular --port "$W" --tokens 8 >"$T/stub.log" 2>&1 &
pids+=($!)
declare -A URL
URL[direct]=http://127.0.0.1:$W
targets=(direct nginx fastproxy)

NG=$(free_port)
start_nginx "$NG=$W"
URL[nginx]=http://127.0.0.1:$NG

FP=$(free_port)
"$BIN/fastproxy" --listen "127.0.0.1:$FP" --backend "127.0.0.1:$W" >"$T/fastproxy.log" 2>&1 &
pids+=($!)
URL[fastproxy]=http://127.0.0.1:$FP

builds=()
for arg in "$@"; do
	name=${arg%%=*} bin=${arg#*=}
	port=$(free_port)
	"$bin" --host 127.0.0.1 --port "$port" --prometheus-port "$(free_port)" --policy round_robin --log-level warn \
		--worker-urls "http://127.0.0.1:$W" >"$T/router-$name.log" 2>&1 &
	pids+=($!)
	URL[$name]=http://127.0.0.1:$port
	targets+=("$name") builds+=("$name")
done
for n in "${targets[@]}"; do
	for _ in $(seq 300); do http_ok "${URL[$n]#http://127.0.0.1:}" /health && break; sleep 0.1; done
	http_ok "${URL[$n]#http://127.0.0.1:}" /health || { log "$n did not come up"; exit 1; }
done

for r in $(seq "$ROUNDS"); do
	order=("${targets[@]}")
	[ $((r % 2)) = 0 ] && mapfile -t order < <(printf '%s\n' "${targets[@]}" | tac)
	for n in "${order[@]}"; do
		"$BIN/pdbench" --backend sglang --base-url "${URL[$n]}" --model mock --dataset-name random \
			--random-input-len 16 --random-output-len 8 --random-range-ratio 1 \
			--num-prompts $((RATE * SECS)) --request-rate "$RATE" --warmup-requests 64 --seed "$RANDOM" \
			--output-file "$T/$n-$r.jsonl" >"$T/$n-$r.txt" 2>"$T/$n-$r.err" || { cat "$T/$n-$r.err" >&2; exit 1; }
		p50=$(tail -n1 "$T/$n-$r.jsonl" | sed -n 's/.*"median_ttft_ms": *\([0-9.eE+-]*\).*/\1/p')
		echo "$n $r $p50" >>"$T/p50.txt"
	done
	log "round $r/$ROUNDS done (load $(cut -d' ' -f1 /proc/loadavg))"
done

median() { sort -g | awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }
# over N: per round, N's p50 minus BASE's, in µs
over() { awk -v n="$1" -v b="$2" '$1 == n {x[$2] = $3} $1 == b {y[$2] = $3} END {for (r in x) printf "%.1f\n", (x[r] - y[r]) * 1000}' "$T/p50.txt"; }
echo "p50 TTFT at $RATE req/s, $ROUNDS rounds of $SECS s (median over rounds, µs):"
for n in "${targets[@]:1}"; do
	line=$(printf '%-10s added over direct %7.1f' "$n" "$(over "$n" direct | median)")
	for b in "${builds[@]}"; do [ "$n" = "$b" ] && line+=$(printf '   − nginx %+7.1f   − fastproxy %+7.1f' "$(over "$n" nginx | median)" "$(over "$n" fastproxy | median)"); done
	echo "$line"
done
