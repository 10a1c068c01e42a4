#!/usr/bin/env bash
# bench-ab: pdrouter builds side by side in one run, for the A/B of a change to the request path.
# Each build runs in regular mode and in PD 1P+1D on the same zero-delay workers; `wrk -t1 -c64`
# posts non-streamed 8-token /generate requests to each in turn, ROUNDS times, so that load from
# elsewhere hits all builds alike. Prints, per build and mode, the best round's req/s, the median
# round's router CPU (user + system) per request and, against the first build, the median of the
# per-round ratios; an A/A pair (one binary under two names) shows the noise of the run.
#
#   scripts/bench-ab.sh NAME=PDROUTER_BINARY NAME=PDROUTER_BINARY...
#
# Knobs (environment): BIN (bin, for the workers); SECS (4) per round; ROUNDS (6); WORKER
# (stubengine, whose fixed replies cost a fraction of the router's request, so that a router
# change shows in req/s; mockworker, SGLang's behaviour in more detail, costs more than the router);
# TOGETHER (0; 1: every build is loaded at once, each by its own wrk, so that a busy box's load
# swings hit all builds alike, at the price of their competing for the cores); SYSCALLS (0; 1: also
# count the router's system calls per request with perf stat, median over rounds); RATE (0: as
# fast as each build answers; N: about N req/s, below saturation, where CPU per request depends
# less on how much of a busy box the router gets).
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { echo "usage: $0 NAME=BINARY NAME=BINARY..." >&2; exit 2; }
BIN=${BIN:-bin}
SECS=${SECS:-4}
ROUNDS=${ROUNDS:-6}
WORKER=${WORKER:-stubengine}
TOGETHER=${TOGETHER:-0}
SYSCALLS=${SYSCALLS:-0}
RATE=${RATE:-0}
SYSCALL_EVENTS=raw_syscalls:sys_enter,syscalls:sys_enter_read,syscalls:sys_enter_write,syscalls:sys_enter_epoll_ctl,syscalls:sys_enter_epoll_pwait,syscalls:sys_enter_futex,syscalls:sys_enter_nanosleep
. scripts/bench-lib.sh
bench_setup bench-ab
check_worker
TICKS=$(getconf CLK_TCK)

start_wrk_worker W regular
start_wrk_worker P prefill
start_wrk_worker D decode

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
# At a fixed rate each of wrk's 64 connections waits 64/RATE s between its requests.
[ "$RATE" -gt 0 ] && echo "function delay() return $((64000 / RATE)) end" >>"$T/post.lua"
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
# load NAME MODE ROUND: wrk against one build, its req/s and CPU per request added to the rounds.
load() {
	local before after out rps n pid=${PID[$1$2]}
	before=$(ticks "$pid")
	local perf=()
	[ "$SYSCALLS" = 1 ] && perf=(perf stat -x, -o "$T/perf-$1$2" -e "$SYSCALL_EVENTS" -p "$pid" --)
	out=$("${perf[@]}" wrk -t1 -c64 -d"${SECS}s" -s "$T/post.lua" "http://127.0.0.1:${PORT[$1$2]}/generate")
	after=$(ticks "$pid")
	[ "$SYSCALLS" = 1 ] && awk -F, -v r="$3 $1 $2" -v n="$(awk '/requests in/ {print $1}' <<<"$out")" \
		'NF > 3 && $1 ~ /^[0-9]+$/ {sub(/.*sys_enter_?/, "", $3); printf "%s %s %.2f\n", r, ($3 == "" ? "all" : $3), $1 / n}' \
		"$T/perf-$1$2" >>"$T/syscalls"
	grep -E 'Non-2xx|Socket errors' <<<"$out" >&2 || true
	rps=$(awk '/^Requests\/sec/ {printf "%.0f", $2}' <<<"$out")
	n=$(awk '/requests in/ {print $1}' <<<"$out")
	echo "$3 $1 $2 $rps $(awk -v t=$((after - before)) -v n="$n" -v hz="$TICKS" 'BEGIN {printf "%.1f", t / hz * 1e6 / n}')" >>"$T/rounds"
}
for ((round = 1; round <= ROUNDS; round++)); do
	for mode in regular pd; do
		if [ "$TOGETHER" = 1 ]; then
			loads=()
			for name in "${names[@]}"; do
				load "$name" "$mode" "$round" &
				loads+=($!)
			done
			wait "${loads[@]}"
			continue
		fi
		# Rotate the order each round.
		for ((i = 0; i < ${#names[@]}; i++)); do
			load "${names[$(((i + round) % ${#names[@]}))]}" "$mode" "$round"
		done
	done
	log "round $round/$ROUNDS done (load $(cut -d' ' -f1 /proc/loadavg))"
done
# Per build and mode: best and worst round's req/s, median round's CPU per request; and for each
# build after the first, the median over rounds of its req/s and CPU per request divided by the
# first build's in the same round, which cancels most of what other load does to both.
median() { sort -g | awk '{v[NR] = $1} END {print v[int((NR + 1) / 2)]}'; }
for mode in regular pd; do
	for name in "${names[@]}"; do
		awk -v n="$name" -v m="$mode" '$2 == n && $3 == m' "$T/rounds" >"$T/sel"
		best=$(cut -d' ' -f4 "$T/sel" | sort -n | tail -n1)
		worst=$(cut -d' ' -f4 "$T/sel" | sort -n | head -n1)
		cpu=$(cut -d' ' -f5 "$T/sel" | median)
		ratios=
		if [ "$name" != "${names[0]}" ]; then
			pair() { # FIELD: this build's value over the first's, per round
				awk -v a="${names[0]}" -v b="$name" -v m="$mode" -v f="$1" \
					'$3 == m && $2 == a {x[$1] = $f} $3 == m && $2 == b {y[$1] = $f}
					END {for (r in y) if (x[r] > 0) print y[r] / x[r]}' "$T/rounds" | median
			}
			ratios=$(printf "  vs %s: req/s x%.3f, CPU/req x%.3f (median of round ratios)" "${names[0]}" "$(pair 4)" "$(pair 5)")
		fi
		printf "%-10s %-8s best %6d req/s  median %6.1f CPU µs/req  (req/s %d..%d over %d rounds)%s\n" \
			"$name" "$mode" "$best" "$cpu" "$worst" "$best" "$(wc -l <"$T/sel")" "$ratios"
	done
done
if [ "$SYSCALLS" = 1 ]; then
	echo "system calls per request (median over rounds):"
	for mode in regular pd; do
		for name in "${names[@]}"; do
			line=$(for call in all read write epoll_ctl epoll_pwait futex nanosleep; do
				printf " %s %s" "$call" "$(awk -v n="$name" -v m="$mode" -v c="$call" '$2 == n && $3 == m && $4 == c {print $5}' "$T/syscalls" | median)"
			done)
			printf "%-10s %-8s%s\n" "$name" "$mode" "$line"
		done
	done
fi
