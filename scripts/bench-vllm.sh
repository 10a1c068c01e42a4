#!/usr/bin/env bash
# make bench-vllm (and make bench): pdrouter --vllm-pd-disaggregation against vllm-router 0.1.17
# (pip, in a cached venv of its own) on the same mock vLLM engines (mockworker --role vllm-prefill
# and vllm-decode, which move their KV over a side channel), side by side in one run, with
# pdbench:
#
#   req/s, CPU:   non-streamed completions (8 tokens) in a closed loop of CONC, N_REQ each round,
#                 ROUNDS rounds alternating the routers; CPU µs per request from the router's own
#                 utime+stime over the round (/proc/PID/stat), and the two engines' over the same
#                 round beside it. Twice: on bench/stubengine's vLLM roles (fixed replies, so the
#                 routers set the pace) and on the mocks (a few times a router's CPU per request:
#                 compressed req/s; CPU per request is the router's alone).
#                 Then both again pinned: each router (a process of its own, started under
#                 taskset, so both size their thread pools to one core) on ROUTER_CPU, the engines
#                 and pdbench on LOAD_CPU, so that the load generator and engines cannot take the
#                 router's core. Every row says how much of a core the router used and how busy
#                 each core was (/proc/stat, other work on the machine included): a router well
#                 under one core on a busy core waits for the CPU or for its engines.
#   TTFT:         streamed requests at LAT_RATE req/s through the mock prefill answering after
#                 SLOW_PREFILL and stubengine's decode (whose first token can be timed alone), and
#                 in the same rounds: the prefill alone (its own time, P), the decode alone (its
#                 first token, D) and the prefill behind one nginx hop (nginx adds H). A router
#                 adds TTFT - P - D, to set against H.
#   streams:      STREAMS streams opened at once (mocks: 16 tokens 10 ms apart, the slow prefill,
#                 the KV pulled): errors and time to the last.
#
# Every router gets: --vllm-pd-disaggregation --prefill URL --decode URL --policy round_robin
# --host --port --prometheus-port. Writes bench/out/vllm.json (one line per row) and prints a
# Markdown table for bench/RESULTS.md. Needs nginx (make bench installs it). Knobs (environment):
# BIN (bin), CONC (32), N_REQ (3000), ROUNDS (4), SLOW_PREFILL (300ms), LAT_RATE (20), LAT_N
# (200), STREAMS (1000), ROUTER_CPU (0), LOAD_CPU (1), PIN (1; 0 leaves the pinned rows out).
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
ROUTER_CPU=${ROUTER_CPU:-0}
LOAD_CPU=${LOAD_CPU:-1}
PIN=${PIN:-1}
OUT=bench/out
for b in pdrouter mockworker stubengine pdbench; do
	[ -x "$BIN/$b" ] || { echo "bench-vllm: $BIN/$b missing; run make build" >&2; exit 1; }
done
command -v nginx >/dev/null || { echo "bench-vllm: nginx missing (scripts/install-deps.sh bench installs it)" >&2; exit 1; }
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
# start_router VAR_PORT VAR_PID KIND PREFILL DECODE [CPU]: alone on CPU when given
start_router() {
	local port prom pid pin=()
	port=$(free_port)
	prom=$(free_port)
	[ -n "${6:-}" ] && pin=(taskset -c "$6")
	local args=(--vllm-pd-disaggregation --prefill "http://127.0.0.1:$4" --decode "http://127.0.0.1:$5"
		--policy round_robin --host 127.0.0.1 --port "$port" --prometheus-port "$prom")
	if [ "$3" = pdrouter ]; then
		"${pin[@]}" "$BIN/pdrouter" "${args[@]}" --log-level warn >"$T/r-$port.log" 2>&1 &
	else
		"${pin[@]}" "$venv/bin/vllm-router" "${args[@]}" --log-level warning >"$T/r-$port.log" 2>&1 &
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
# engine_ticks ENGINES: the CPU ticks so far of the rows' two engines (stub or mock)
engine_ticks() {
	local p t=0
	if [[ $1 == stub* ]]; then p=("${STUB_PIDS[@]}"); else p=("${ENGINE_PIDS[@]}"); fi
	for pid in "${p[@]}"; do t=$((t + $(cpu_ticks "$pid"))); done
	echo "$t"
}
# core_ticks CPU: that core's busy and total ticks so far (/proc/stat; idle and iowait are not busy)
core_ticks() { awk -v c="cpu$1" '$1 == c {t = 0; for (i = 2; i <= NF; i++) t += $i; print t - $5 - $6, t}' /proc/stat; }
TCK=$(getconf CLK_TCK)
LOADPIN=() # pdbench's taskset in the pinned rows
bench() { # PORT OUTFILE ARGS...
	local port=$1 out=$2
	shift 2
	"${LOADPIN[@]}" "$BIN/pdbench" --backend openai --base-url "http://127.0.0.1:$port" --model mock --output-file "$out" "$@" >"$T/pdbench.log" 2>&1 ||
		{ log "pdbench failed:"; tail -5 "$T/pdbench.log" >&2; exit 1; }
}
# field FILE KEY [DIGITS]: a number of pdbench's last result line, rounded to DIGITS (1) decimals
field() { python3 -c "import json,sys; v=json.loads(open(sys.argv[1]).readlines()[-1])[sys.argv[2]]; print(round(v, int(sys.argv[3])) if isinstance(v, float) else v)" "$1" "$2" "${3:-1}"; }
# pin_engines CPUS: every thread of the req/s rows' engines onto CPUS
pin_engines() { for p in "${ENGINE_PIDS[@]}"; do taskset -a -p -c "$1" "$p" >/dev/null; done; }
median() { tr ' ' '\n' | grep . | sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
py() { python3 -c "print($1)"; }

start_stub BP vllm-prefill
start_stub BD vllm-decode
STUB_PIDS=("${pids[@]}")
start_engine FP vllm-prefill
start_engine FD vllm-decode --tokens 8
ENGINE_PIDS=("${pids[@]:2}")
start_engine SP vllm-prefill --prefill-delay "$SLOW_PREFILL" --vllm-kv-timeout 30s
start_engine SD vllm-decode --tokens 16 --token-delay 10ms
start_stub TD vllm-decode
declare -A PORT PID SPORT TPORT
rows=(stub mock)
[ "$PIN" = 1 ] && rows+=(stub-pinned mock-pinned)
for k in pdrouter vllm-router; do
	start_router "PORT[stub-$k]" "PID[stub-$k]" "$k" "$BP" "$BD"
	start_router "PORT[mock-$k]" "PID[mock-$k]" "$k" "$FP" "$FD"
	if [ "$PIN" = 1 ]; then
		start_router "PORT[stub-pinned-$k]" "PID[stub-pinned-$k]" "$k" "$BP" "$BD" "$ROUTER_CPU"
		start_router "PORT[mock-pinned-$k]" "PID[mock-pinned-$k]" "$k" "$FP" "$FD" "$ROUTER_CPU"
	fi
	start_router "SPORT[$k]" SPID "$k" "$SP" "$SD"
	start_router "TPORT[$k]" SPID "$k" "$SP" "$TD"
done
NGINX=$(free_port)
start_nginx "$NGINX=$SP"
wait_health "$NGINX"
: >"$OUT/vllm.json"

declare -A RPS CPU ECPU BUSY_R BUSY_L
for engines in "${rows[@]}"; do
	LOADPIN=()
	if [[ $engines == *-pinned ]]; then
		pin_engines "$LOAD_CPU"
		LOADPIN=(taskset -c "$LOAD_CPU")
	fi
	for round in $(seq "$ROUNDS"); do
		order=(pdrouter vllm-router)
		((round % 2)) || order=(vllm-router pdrouter)
		for k in "${order[@]}"; do
			c0=$(cpu_ticks "${PID[$engines-$k]}")
			e0=$(engine_ticks "$engines")
			read -r rb0 rt0 < <(core_ticks "$ROUTER_CPU")
			read -r lb0 lt0 < <(core_ticks "$LOAD_CPU")
			bench "${PORT[$engines-$k]}" "$T/rps.json" --num-prompts "$N_REQ" --max-concurrency "$CONC" --random-input-len 64 \
				--random-output-len 8 --disable-stream
			c1=$(cpu_ticks "${PID[$engines-$k]}")
			e1=$(engine_ticks "$engines")
			read -r rb1 rt1 < <(core_ticks "$ROUTER_CPU")
			read -r lb1 lt1 < <(core_ticks "$LOAD_CPU")
			[ "$(field "$T/rps.json" failed)" = 0 ] || { log "$engines $k: failed requests"; exit 1; }
			rps=$(field "$T/rps.json" request_throughput)
			cpu=$(py "round(($c1-$c0)*1e6/$TCK/$N_REQ, 1)")
			ecpu=$(py "round(($e1-$e0)*1e6/$TCK/$N_REQ, 1)")
			busy_r=$(py "round(100*($rb1-$rb0)/max($rt1-$rt0,1))")
			busy_l=$(py "round(100*($lb1-$lb0)/max($lt1-$lt0,1))")
			RPS[$engines-$k]+="$rps "
			CPU[$engines-$k]+="$cpu "
			ECPU[$engines-$k]+="$ecpu "
			BUSY_R[$engines-$k]+="$busy_r "
			BUSY_L[$engines-$k]+="$busy_l "
			echo "{\"row\":\"rps\",\"engines\":\"$engines\",\"router\":\"$k\",\"round\":$round,\"req_s\":$rps,\"cpu_us_per_req\":$cpu,\"engines_cpu_us_per_req\":$ecpu,\"router_core_busy_pct\":$busy_r,\"load_core_busy_pct\":$busy_l}" >>"$OUT/vllm.json"
			log "$engines round $round $k: $rps req/s, $cpu µs CPU/request (engines $ecpu), cores $ROUTER_CPU/$LOAD_CPU busy $busy_r/$busy_l %"
		done
	done
	if [[ $engines == *-pinned ]]; then
		pin_engines "0-$(($(nproc) - 1))"
	fi
done
LOADPIN=()

# TTFT: both routers over (slow prefill, stub decode), and the parts alone, one after the other in
# each of ROUNDS rounds; the median of the rounds' medians.
lat() { # PORT ARGS...: the median TTFT of LAT_N requests at LAT_RATE req/s, to 2 decimals
	local port=$1
	shift
	bench "$port" "$T/lat.json" --num-prompts "$LAT_N" --request-rate "$LAT_RATE" --random-input-len 64 "$@"
	[ "$(field "$T/lat.json" failed)" = 0 ] || { log "TTFT run on port $port: failed requests"; exit 1; }
	field "$T/lat.json" median_ttft_ms 2
}
ASK_PREFILL='{"kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false}}'
AS_DECODE='{"kv_transfer_params":{"do_remote_decode":false,"do_remote_prefill":true}}'
declare -A TTFT
for round in $(seq "$ROUNDS"); do
	for k in pdrouter vllm-router; do
		TTFT[$k]+="$(lat "${TPORT[$k]}" --random-output-len 8) "
	done
	TTFT[prefill]+="$(lat "$SP" --random-output-len 1 --disable-stream --extra-request-body "$ASK_PREFILL") "
	TTFT[nginx]+="$(lat "$NGINX" --random-output-len 1 --disable-stream --extra-request-body "$ASK_PREFILL") "
	TTFT[decode]+="$(lat "$TD" --random-output-len 8 --extra-request-body "$AS_DECODE") "
	log "TTFT round $round, ms (pdrouter vllm-router prefill nginx decode): $(for k in pdrouter vllm-router prefill nginx decode; do echo "${TTFT[$k]}" | awk '{printf "%s ", $NF}'; done)"
done
for k in "${!TTFT[@]}"; do
	TTFT[$k]=$(echo "${TTFT[$k]}" | median)
done
P_ADD=$(py "round(${TTFT[pdrouter]} - ${TTFT[prefill]} - ${TTFT[decode]}, 2)")
V_ADD=$(py "round(${TTFT[vllm-router]} - ${TTFT[prefill]} - ${TTFT[decode]}, 2)")
HOP=$(py "round(${TTFT[nginx]} - ${TTFT[prefill]}, 2)")
echo "{\"row\":\"ttft\",\"prefill_ms\":${TTFT[prefill]},\"decode_first_token_ms\":${TTFT[decode]},\"nginx_prefill_ms\":${TTFT[nginx]},\"pdrouter_ms\":${TTFT[pdrouter]},\"vllm_router_ms\":${TTFT[vllm-router]},\"pdrouter_added_ms\":$P_ADD,\"vllm_router_added_ms\":$V_ADD,\"nginx_hop_ms\":$HOP}" >>"$OUT/vllm.json"

declare -A SDUR SFAIL
for k in pdrouter vllm-router; do
	bench "${SPORT[$k]}" "$T/streams.json" --num-prompts "$STREAMS" --random-input-len 32 --random-output-len 16
	SDUR[$k]=$(field "$T/streams.json" duration)
	SFAIL[$k]=$(field "$T/streams.json" failed)
	echo "{\"row\":\"streams\",\"router\":\"$k\",\"streams\":$STREAMS,\"streams_failed\":${SFAIL[$k]},\"streams_s\":${SDUR[$k]}}" >>"$OUT/vllm.json"
done

ratio() { py "f'{$1:.2f}'"; }
echo "| vLLM PD, 1 prefill + 1 decode ($(date -u +%H:%M) UTC, load $(cut -d' ' -f1-3 /proc/loadavg)) | pdrouter | vllm-router 0.1.17 | ratio |"
echo "| --- | ---: | ---: | ---: |"
for engines in "${rows[@]}"; do
	label="${engines%-pinned} engines"
	[[ $engines == *-pinned ]] && label+=", router pinned to core $ROUTER_CPU, engines and pdbench to core $LOAD_CPU"
	P_RPS=$(echo "${RPS[$engines-pdrouter]}" | median) V_RPS=$(echo "${RPS[$engines-vllm-router]}" | median)
	P_CPU=$(echo "${CPU[$engines-pdrouter]}" | median) V_CPU=$(echo "${CPU[$engines-vllm-router]}" | median)
	echo "| $label: req/s, non-streamed, $CONC in flight (median of $ROUNDS) | $P_RPS | $V_RPS | ×$(ratio "$P_RPS/$V_RPS") |"
	echo "| $label: router CPU µs per request (median of $ROUNDS) | $P_CPU | $V_CPU | ×$(ratio "$P_CPU/$V_CPU") |"
	echo "| $label: the two engines' CPU µs per request, same rounds (median) | $(echo "${ECPU[$engines-pdrouter]}" | median) | $(echo "${ECPU[$engines-vllm-router]}" | median) | |"
	share() { py "round($(echo "${CPU[$engines-$1]}" | median) * $(echo "${RPS[$engines-$1]}" | median) / 1e4)"; }
	echo "| $label: the router's CPU in % of one core; core $ROUTER_CPU / core $LOAD_CPU busy % (medians) | $(share pdrouter); $(echo "${BUSY_R[$engines-pdrouter]}" | median) / $(echo "${BUSY_L[$engines-pdrouter]}" | median) | $(share vllm-router); $(echo "${BUSY_R[$engines-vllm-router]}" | median) / $(echo "${BUSY_L[$engines-vllm-router]}" | median) | |"
done
cat <<EOF
| TTFT p50, mock prefill $SLOW_PREFILL + stub decode, $LAT_RATE req/s (ms; median of $ROUNDS rounds) | ${TTFT[pdrouter]} | ${TTFT[vllm-router]} | |
| added by the router: TTFT − the prefill alone (${TTFT[prefill]}) − the decode's first token alone (${TTFT[decode]}) | $P_ADD | $V_ADD | |
| one nginx hop in front of the prefill, same rounds: ${TTFT[nginx]} − ${TTFT[prefill]} | $HOP | $HOP | |
| $STREAMS streams at once (mocks, KV pulled): failed, seconds to the last | ${SFAIL[pdrouter]}, ${SDUR[pdrouter]} | ${SFAIL[vllm-router]}, ${SDUR[vllm-router]} | |
EOF
