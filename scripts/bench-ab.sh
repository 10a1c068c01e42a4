#!/usr/bin/env bash
# bench-ab: pdrouter builds side by side in one run, for the A/B of a change to the request path.
# Each build runs in regular mode and in PD 1P+1D on the same zero-delay mockworkers; `wrk -t1
# -c64` posts non-streamed 8-token /generate requests to each in turn, ROUNDS times, so that load
# from elsewhere hits all builds alike. Prints, per build and mode, the best round's req/s and
# the median round's router CPU (user + system) per request.
#
#   scripts/bench-ab.sh NAME=PDROUTER_BINARY NAME=PDROUTER_BINARY...
#
# Knobs (environment): BIN (bin, for mockworker); SECS (4) per round; ROUNDS (6).
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { echo "usage: $0 NAME=BINARY NAME=BINARY..." >&2; exit 2; }
BIN=${BIN:-bin}
SECS=${SECS:-4}
ROUNDS=${ROUNDS:-6}
. scripts/bench-lib.sh
bench_setup bench-ab
TICKS=$(getconf CLK_TCK)

worker() { # VAR ROLE
	local port
	port=$(free_port)
	"$BIN/mockworker" --role "$2" --port "$port" --tokens 8 --token-delay 0 --record-requests -1 >"$T/mw-$port.log" 2>&1 &
	pids+=($!)
	until http_ok "$port" /health; do sleep 0.1; done
	printf -v "$1" %s "$port"
}
worker W regular
worker P prefill
worker D decode

declare -A PORT PID
names=()
for arg in "$@"; do
	name=${arg%%=*} bin=${arg#*=}
	names+=("$name")
	for mode in regular pd; do
		args=(--worker-urls "http://127.0.0.1:$W")
		[ "$mode" = pd ] && args=(--pd-disaggregation --prefill "http://127.0.0.1:$P" 8998 --decode "http://127.0.0.1:$D")
		port=$(free_port)
		"$bin" --host 127.0.0.1 --port "$port" --prometheus-port "$(free_port)" --policy round_robin --log-level warn \
			"${args[@]}" >"$T/router-$name-$mode.log" 2>&1 &
		pids+=($!)
		PORT[$name$mode]=$port PID[$name$mode]=$!
	done
done
for k in "${!PORT[@]}"; do until http_ok "${PORT[$k]}" /readiness; do sleep 0.1; done; done
cat >"$T/post.lua" <<-'EOF'
	wrk.method = "POST"
	wrk.headers["Content-Type"] = "application/json"
	wrk.body = '{"text":"the quick brown fox jumps over the lazy dog","sampling_params":{"max_new_tokens":8},"stream":false}'
EOF
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
for ((round = 1; round <= ROUNDS; round++)); do
	for mode in regular pd; do
		# Rotate the order each round.
		for ((i = 0; i < ${#names[@]}; i++)); do
			name=${names[$(((i + round) % ${#names[@]}))]}
			before=$(ticks "${PID[$name$mode]}")
			out=$(wrk -t1 -c64 -d"${SECS}s" -s "$T/post.lua" "http://127.0.0.1:${PORT[$name$mode]}/generate")
			after=$(ticks "${PID[$name$mode]}")
			grep -E 'Non-2xx|Socket errors' <<<"$out" >&2 || true
			rps=$(awk '/^Requests\/sec/ {printf "%.0f", $2}' <<<"$out")
			n=$(awk '/requests in/ {print $1}' <<<"$out")
			echo "$name $mode $rps $(awk -v t=$((after - before)) -v n="$n" -v hz="$TICKS" 'BEGIN {printf "%.1f", t / hz * 1e6 / n}')" >>"$T/rounds"
		done
	done
	log "round $round/$ROUNDS done (load $(cut -d' ' -f1 /proc/loadavg))"
done
for mode in regular pd; do
	for name in "${names[@]}"; do
		awk -v n="$name" -v m="$mode" '$1 == n && $2 == m' "$T/rounds" >"$T/sel"
		best=$(cut -d' ' -f3 "$T/sel" | sort -n | tail -n1)
		worst=$(cut -d' ' -f3 "$T/sel" | sort -n | head -n1)
		cpu=$(cut -d' ' -f4 "$T/sel" | sort -g | awk '{v[NR] = $1} END {print v[int((NR + 1) / 2)]}')
		printf "%-10s %-8s best %6d req/s  median %6.1f CPU µs/req  (req/s %d..%d over %d rounds)\n" \
			"$name" "$mode" "$best" "$cpu" "$worst" "$best" "$(wc -l <"$T/sel")"
	done
done
