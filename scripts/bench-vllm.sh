#!/usr/bin/env bash
# make bench-vllm (and make bench): pdrouter --vllm-pd-disaggregation against vllm-router 0.1.17
# (pip, in a cached venv of its own) on the same mock vLLM engines (mockworker --role vllm-prefill
# and vllm-decode, which move their KV over a side channel), side by side in one run, with
# pdbench:
#
#   req/s, CPU:   non-streamed completions (8 tokens) in a closed loop of CONC, N_REQ each round,
#                 ROUNDS rounds alternating the routers; CPU µs per request from the router's own
#                 utime+stime over the round (/proc/PID/stat). Twice: on bench/stubengine's vLLM
#                 roles (fixed replies, so the routers set the pace) and on the mocks (which take
#                 most of the 2 cores: compressed req/s; CPU per request is the router's alone).
#   slow prefill: TTFT of streamed requests at LAT_RATE req/s when prefill answers after
#                 SLOW_PREFILL (decode's first token comes at once): the routers' added TTFT is
#                 TTFT - SLOW_PREFILL.
#   streams:      STREAMS streams opened at once (16 tokens 10 ms apart, the slow prefill): errors
#                 and time to the last.
#
# Every router gets: --vllm-pd-disaggregation --prefill URL --decode URL --policy round_robin
# --host --port --prometheus-port. Writes bench/out/vllm.json (one line per row) and prints a
# Markdown table for bench/RESULTS.md. Knobs (environment): BIN (bin), CONC (32), N_REQ (3000),
# ROUNDS (4), SLOW_PREFILL (300ms), LAT_RATE (20), LAT_N (200), STREAMS (1000).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/bench-lib.sh
BIN=${BIN:-bin}
CONC=${CONC:-32}
N_REQ=${N_REQ:-3000}
ROUNDS=${ROUNDS:-4}
SLOW_PREFILL=${SLOW_PREFILL:-300ms}
LAT_RATE=${LAT_RATE:-20}
LAT_N=${LAT_N:-200}
STREAMS=${STREAMS:-1000}
OUT=bench/out
for b in pdrouter mockworker stubengine pdbench; do
	[ -x "$BIN/$b" ] || { echo "bench-vllm: $BIN/$b missing; run make build" >&2; exit 1; }
done
bench_setup bench-vllm
mkdir -p "$OUT"
ulimit -n "$(ulimit -Hn)"

# vllm-router's venv, keyed by its pin and the Python version.
pin=vllm-router==0.1.17
py=${PYTHON:-python3}
key=$( (echo "$pin"; $py -c 'import sys; print(sys.version)') | sha256sum | cut -c1-16)
venv=${PDROUTER_BENCH_VENV_CACHE:-$HOME/.cache/pdrouter-bench-venv}/vllm-$key
if [ ! -e "$venv/.complete" ]; then
	log "installing $pin into $venv"
	rm -rf "$venv"
	mkdir -p "$(dirname "$venv")"
	$py -m venv "$venv"
	"$venv/bin/pip" install -q --disable-pip-version-check "$pin" >&2
	touch "$venv/.complete"
fi

wait_health() { # PORT
	for _ in $(seq 300); do http_ok "$1" /health && return; sleep 0.1; done
	log "nothing answers /health on $1"; exit 1
}
start_engine() { # VAR ROLE ARGS...
	local var=$1 role=$2 port
	shift 2
	port=$(free_port)
	"$BIN/mockworker" --role "$role" --port "$port" --record-requests -1 "$@" >"$T/e-$port.log" 2>&1 &
	pids+=($!)
	wait_health "$port"
	printf -v "$var" %s "$port"
}
start_stub() { # VAR ROLE
	local var=$1 port
	port=$(free_port)
	"$BIN/stubengine" --role "$2" --port "$port" --tokens 8 >"$T/e-$port.log" 2>&1 &
	pids+=($!)
	wait_health "$port"
	printf -v "$var" %s "$port"
}
# start_router VAR_PORT VAR_PID KIND PREFILL DECODE
start_router() {
	local port prom pid
	port=$(free_port)
	prom=$(free_port)
	local args=(--vllm-pd-disaggregation --prefill "http://127.0.0.1:$4" --decode "http://127.0.0.1:$5"
		--policy round_robin --host 127.0.0.1 --port "$port" --prometheus-port "$prom")
	if [ "$3" = pdrouter ]; then
		"$BIN/pdrouter" "${args[@]}" --log-level warn >"$T/r-$port.log" 2>&1 &
	else
		"$venv/bin/vllm-router" "${args[@]}" --log-level warning >"$T/r-$port.log" 2>&1 &
	fi
	pid=$!
	pids+=("$pid")
	wait_health "$port"
	# the process serving the port (vllm-router's Python launcher may hand over to its Rust core)
	pid=$(ss -ltnpH "sport = :$port" | grep -o 'pid=[0-9]*' | head -1 | cut -d= -f2)
	printf -v "$1" %s "$port"
	printf -v "$2" %s "$pid"
}
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
TCK=$(getconf CLK_TCK)
bench() { # PORT OUTFILE ARGS...
	local port=$1 out=$2
	shift 2
	"$BIN/pdbench" --backend openai --base-url "http://127.0.0.1:$port" --model mock --output-file "$out" "$@" >"$T/pdbench.log" 2>&1 ||
		{ log "pdbench failed:"; tail -5 "$T/pdbench.log" >&2; exit 1; }
}
# field FILE KEY: a number of pdbench's last result line, rounded to one decimal
field() { python3 -c "import json,sys; v=json.loads(open(sys.argv[1]).readlines()[-1])[sys.argv[2]]; print(round(v, 1) if isinstance(v, float) else v)" "$1" "$2"; }

start_stub BP vllm-prefill
start_stub BD vllm-decode
start_engine FP vllm-prefill
start_engine FD vllm-decode --tokens 8
start_engine SP vllm-prefill --prefill-delay "$SLOW_PREFILL"
start_engine SD vllm-decode --tokens 16 --token-delay 10ms
declare -A PORT PID SPORT
for k in pdrouter vllm-router; do
	start_router "PORT[stub-$k]" "PID[stub-$k]" "$k" "$BP" "$BD"
	start_router "PORT[mock-$k]" "PID[mock-$k]" "$k" "$FP" "$FD"
	start_router "SPORT[$k]" SPID "$k" "$SP" "$SD"
done
: >"$OUT/vllm.json"
declare -A RPS CPU
for engines in stub mock; do
	for round in $(seq "$ROUNDS"); do
		order=(pdrouter vllm-router)
		((round % 2)) || order=(vllm-router pdrouter)
		for k in "${order[@]}"; do
			c0=$(cpu_ticks "${PID[$engines-$k]}")
			bench "${PORT[$engines-$k]}" "$T/rps.json" --num-prompts "$N_REQ" --max-concurrency "$CONC" --random-input-len 64 \
				--random-output-len 8 --disable-stream
			c1=$(cpu_ticks "${PID[$engines-$k]}")
			[ "$(field "$T/rps.json" failed)" = 0 ] || { log "$engines $k: failed requests"; exit 1; }
			rps=$(field "$T/rps.json" request_throughput)
			cpu=$(python3 -c "print(round(($c1-$c0)*1e6/$TCK/$N_REQ, 1))")
			RPS[$engines-$k]+="$rps "
			CPU[$engines-$k]+="$cpu "
			echo "{\"row\":\"rps\",\"engines\":\"$engines\",\"router\":\"$k\",\"round\":$round,\"req_s\":$rps,\"cpu_us_per_req\":$cpu}" >>"$OUT/vllm.json"
			log "$engines round $round $k: $rps req/s, $cpu µs CPU/request"
		done
	done
done
median() { tr ' ' '\n' | grep . | sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
declare -A TTFT50 TTFT99 SDUR SFAIL
for k in pdrouter vllm-router; do
	bench "${SPORT[$k]}" "$T/lat.json" --num-prompts "$LAT_N" --request-rate "$LAT_RATE" --random-input-len 64 --random-output-len 16
	TTFT50[$k]=$(field "$T/lat.json" median_ttft_ms)
	TTFT99[$k]=$(field "$T/lat.json" p99_ttft_ms)
	bench "${SPORT[$k]}" "$T/streams.json" --num-prompts "$STREAMS" --random-input-len 32 --random-output-len 16
	SDUR[$k]=$(field "$T/streams.json" duration)
	SFAIL[$k]=$(field "$T/streams.json" failed)
	echo "{\"row\":\"slow_prefill\",\"router\":\"$k\",\"median_ttft_ms\":${TTFT50[$k]},\"p99_ttft_ms\":${TTFT99[$k]},\"streams\":$STREAMS,\"streams_failed\":${SFAIL[$k]},\"streams_s\":${SDUR[$k]}}" >>"$OUT/vllm.json"
done
r() { python3 -c "print(f'{$1:.2f}')"; }
echo "| vLLM PD, 1 prefill + 1 decode ($(date -u +%H:%M) UTC, load $(cut -d' ' -f1-3 /proc/loadavg)) | pdrouter | vllm-router 0.1.17 | ratio |"
echo "| --- | ---: | ---: | ---: |"
for engines in stub mock; do
	P_RPS=$(echo "${RPS[$engines-pdrouter]}" | median) V_RPS=$(echo "${RPS[$engines-vllm-router]}" | median)
	P_CPU=$(echo "${CPU[$engines-pdrouter]}" | median) V_CPU=$(echo "${CPU[$engines-vllm-router]}" | median)
	echo "| $engines engines: req/s, non-streamed, $CONC in flight (median of $ROUNDS) | $P_RPS | $V_RPS | ×$(r "$P_RPS/$V_RPS") |"
	echo "| $engines engines: router CPU µs per request (median of $ROUNDS) | $P_CPU | $V_CPU | ×$(r "$P_CPU/$V_CPU") |"
done
cat <<EOF
| TTFT p50 / p99, prefill $SLOW_PREFILL, $LAT_RATE req/s (ms) | ${TTFT50[pdrouter]} / ${TTFT99[pdrouter]} | ${TTFT50[vllm-router]} / ${TTFT99[vllm-router]} | |
| $STREAMS streams at once: failed, seconds | ${SFAIL[pdrouter]}, ${SDUR[pdrouter]} | ${SFAIL[vllm-router]}, ${SDUR[vllm-router]} | |
EOF
