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
#                 first token, D), the prefill behind one nginx hop (nginx adds H) and the
#                 decode behind one (streamed: H' without the prefill's timer in it). A router
#                 adds TTFT - P - D, to set against H and H'. The box's load moves TTFT by more
#                 than what is measured from one second to the next, so all targets are timed at
#                 the same time (a pdbench each), each round's added times come from its own P, D
#                 and H, and the table gives the median over LAT_ROUNDS rounds with the rounds'
#                 spread (min–max).
#   streams:      STREAMS streams opened at once (mocks: 16 tokens 10 ms apart, the slow prefill,
#                 the KV pulled): errors and time to the last.
#
# Every router gets: --vllm-pd-disaggregation --prefill URL --decode URL --policy round_robin
# --host --port --prometheus-port. BASE=PDROUTER_BINARY adds that build as a third router
# ("base") to every row and round, for a same-run before/after of a pdrouter change. Writes
# bench/out/vllm.json (one line per row) and prints a Markdown table for bench/RESULTS.md. Needs
# nginx (make bench installs it). Knobs (environment): BIN (bin), BASE (none), CONC (32), N_REQ
# (3000), ROUNDS (4), ROWS (stub mock stub-pinned mock-pinned; none: TTFT and streams only),
# SLOW_PREFILL (300ms), LAT_RATE (20), LAT_N (100), LAT_ROUNDS (8; 0 leaves TTFT out), STREAMS
# (1000; 0 leaves them out), ROUTER_CPU (0), LOAD_CPU (1; a taskset list such as 1-15 gives the
# engines and pdbench several cores, and the busy % is then theirs together), PIN (1; 0 leaves the
# pinned rows out), VLLM_ROUTER (none: pip installs vllm-router into a cached venv; else the path
# of an installed vllm-router launcher).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/bench-lib.sh
BIN=${BIN:-bin}
CONC=${CONC:-32}
N_REQ=${N_REQ:-3000}
ROUNDS=${ROUNDS:-4}
SLOW_PREFILL=${SLOW_PREFILL:-300ms}
LAT_RATE=${LAT_RATE:-20}
LAT_N=${LAT_N:-100}
LAT_ROUNDS=${LAT_ROUNDS:-8}
BASE=${BASE:-}
STREAMS=${STREAMS:-1000}
ROUTER_CPU=${ROUTER_CPU:-0}
LOAD_CPU=${LOAD_CPU:-1}
PIN=${PIN:-1}
OUT=bench/out
for b in pdrouter mockworker stubengine pdbench; do
	[ -x "$BIN/$b" ] || { echo "bench-vllm: $BIN/$b missing; run make build" >&2; exit 1; }
done
[ -z "$BASE" ] || [ -x "$BASE" ] || { echo "bench-vllm: BASE=$BASE is not an executable" >&2; exit 1; }
command -v nginx >/dev/null || { echo "bench-vllm: nginx missing (scripts/install-deps.sh bench installs it)" >&2; exit 1; }
bench_setup bench-vllm
mkdir -p "$OUT"
ulimit -n "$(ulimit -Hn)"

# vllm-router: the launcher VLLM_ROUTER names (scripts/devbench-run.sh's, where no index can be
# reached), else pip's in a venv cached by its pin and the Python version.
if [ -n "${VLLM_ROUTER:-}" ]; then
	[ -x "$VLLM_ROUTER" ] || { echo "bench-vllm: VLLM_ROUTER=$VLLM_ROUTER is not an executable" >&2; exit 1; }
else
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
	VLLM_ROUTER=$venv/bin/vllm-router
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
	elif [ "$3" = base ]; then
		"${pin[@]}" "$BASE" "${args[@]}" --log-level warn >"$T/r-$port.log" 2>&1 &
	else
		"${pin[@]}" "$VLLM_ROUTER" "${args[@]}" --log-level warning >"$T/r-$port.log" 2>&1 &
	fi
	pid=$!
	pids+=("$pid")
	wait_health "$port"
	# the process serving the port (vllm-router's Python launcher may hand over to its Rust core)
	pid=$(listener_pid "$port")
	[ -n "$pid" ] || { log "$3: no process found listening on $port"; exit 1; }
	printf -v "$1" %s "$port"
	printf -v "$2" %s "$pid"
}
# listener_pid PORT: the process holding PORT's listening socket, from /proc (no ss needed)
listener_pid() {
	python3 - "$1" <<-'PY'
	import os, sys
	port, sockets = int(sys.argv[1]), set()
	for table in ("/proc/net/tcp", "/proc/net/tcp6"):
	    if os.path.exists(table):
	        for row in open(table).read().splitlines()[1:]:
	            f = row.split()
	            if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
	                sockets.add("socket:[%s]" % f[9])
	def holds(pid):
	    try:
	        return any(os.readlink("/proc/%s/fd/%s" % (pid, fd)) in sockets for fd in os.listdir("/proc/%s/fd" % pid))
	    except OSError:  # gone, or not ours to read
	        return False
	print(next((pid for pid in filter(str.isdigit, os.listdir("/proc")) if holds(pid)), ""))
	PY
}
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
# engine_ticks ENGINES: the CPU ticks so far of the rows' two engines (stub or mock)
engine_ticks() {
	local p t=0
	if [[ $1 == stub* ]]; then p=("${STUB_PIDS[@]}"); else p=("${ENGINE_PIDS[@]}"); fi
	for pid in "${p[@]}"; do t=$((t + $(cpu_ticks "$pid"))); done
	echo "$t"
}
# core_ticks CPUS: busy and total ticks so far of the cores of a taskset list (3, 1-15, 0,2-3),
# summed (/proc/stat; idle and iowait are not busy)
core_ticks() {
	awk -v list="$1" 'BEGIN {
		n = split(list, part, ",")
		for (i = 1; i <= n; i++) {
			m = split(part[i], r, "-")
			for (c = +r[1]; c <= +r[m]; c++) want["cpu" c] = 1
		}
	}
	$1 in want {t = 0; for (i = 2; i <= NF; i++) t += $i; busy += t - $5 - $6; total += t; found++}
	END {if (found) print busy, total}' /proc/stat
}
TCK=$(getconf CLK_TCK)
for c in "$ROUTER_CPU" "$LOAD_CPU"; do
	[ -n "$(core_ticks "$c")" ] || { log "no core $c on this machine (ROUTER_CPU, LOAD_CPU)"; exit 1; }
done
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
cores() { [[ $1 == *[,-]* ]] && echo "cores $1" || echo "core $1"; } # CPUS: a label

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
[ -z "${ROWS:-}" ] || read -ra rows <<<"$ROWS"
[ "${ROWS:-}" != none ] || rows=()
routers=(pdrouter vllm-router)
[ -z "$BASE" ] || routers+=(base)
for k in "${routers[@]}"; do
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
NGINX_D=$(free_port)
start_nginx "$NGINX=$SP" "$NGINX_D=$TD"
wait_health "$NGINX"
wait_health "$NGINX_D"
: >"$OUT/vllm.json"

declare -A RPS CPU ECPU BUSY_R BUSY_L
for engines in "${rows[@]}"; do
	LOADPIN=()
	if [[ $engines == *-pinned ]]; then
		pin_engines "$LOAD_CPU"
		LOADPIN=(taskset -c "$LOAD_CPU")
	fi
	for round in $(seq "$ROUNDS"); do
		order=("${routers[@]}")
		((round % 2)) || mapfile -t order < <(printf '%s\n' "${routers[@]}" | tac)
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

if [ "$LAT_ROUNDS" -gt 0 ]; then
# TTFT: the routers over (slow prefill, stub decode) and the parts alone, all at the same time
# (one pdbench each), so that the box's load, which moves by more than what is measured from one
# second to the next, hits them alike; LAT_ROUNDS rounds, each round's added times against its
# own parts.
lat() { # KEY PORT ARGS...: starts LAT_N requests at LAT_RATE req/s to PORT, results in $T/lat-KEY.json
	local k=$1 port=$2
	shift 2
	"$BIN/pdbench" --backend openai --base-url "http://127.0.0.1:$port" --model mock --output-file "$T/lat-$k.json" \
		--num-prompts "$LAT_N" --request-rate "$LAT_RATE" --random-input-len 64 "$@" >"$T/lat-$k.log" 2>&1 &
	latp+=($!)
}
ASK_PREFILL='{"kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false}}'
AS_DECODE='{"kv_transfer_params":{"do_remote_decode":false,"do_remote_prefill":true}}'
declare -A TTFT ADD
targets=("${routers[@]}" prefill nginx decode nginx-decode)
for round in $(seq "$LAT_ROUNDS"); do
	declare -A now=()
	latp=()
	lat prefill "$SP" --random-output-len 1 --disable-stream --extra-request-body "$ASK_PREFILL"
	lat nginx "$NGINX" --random-output-len 1 --disable-stream --extra-request-body "$ASK_PREFILL"
	lat decode "$TD" --random-output-len 8 --extra-request-body "$AS_DECODE"
	lat nginx-decode "$NGINX_D" --random-output-len 8 --extra-request-body "$AS_DECODE"
	for k in "${routers[@]}"; do lat "$k" "${TPORT[$k]}" --random-output-len 8; done
	for p in "${latp[@]}"; do wait "$p" || true; done # a failure shows in its results below
	for k in "${targets[@]}"; do
		[ -s "$T/lat-$k.json" ] && [ "$(field "$T/lat-$k.json" failed)" = 0 ] || { log "TTFT run to $k failed:"; tail -5 "$T/lat-$k.log" >&2; exit 1; }
		now[$k]=$(field "$T/lat-$k.json" median_ttft_ms 3)
		rm -f "$T/lat-$k.json"
		TTFT[$k]+="${now[$k]} "
	done
	for k in "${routers[@]}"; do
		ADD[$k]+="$(py "round(${now[$k]} - ${now[prefill]} - ${now[decode]}, 3)") "
	done
	ADD[nginx]+="$(py "round(${now[nginx]} - ${now[prefill]}, 3)") "
	ADD[nginx-decode]+="$(py "round(${now[nginx-decode]} - ${now[decode]}, 3)") "
	log "TTFT round $round, ms: $(for k in "${targets[@]}"; do printf '%s %s  ' "$k" "${now[$k]}"; done); added: $(for k in "${routers[@]}" nginx nginx-decode; do printf '%s %s  ' "$k" "$(echo "${ADD[$k]}" | awk '{print $NF}')"; done)"
done
spread() { tr ' ' '\n' | grep . | sort -g | awk '{a[NR]=$1} END {printf "%s–%s", a[1], a[NR]}'; }
declare -A TMED ASPREAD
for k in "${!TTFT[@]}"; do TMED[$k]=$(echo "${TTFT[$k]}" | median); done
for k in "${!ADD[@]}"; do
	ASPREAD[$k]=$(echo "${ADD[$k]}" | spread)
	ADD[$k]=$(echo "${ADD[$k]}" | median)
done
echo "{\"row\":\"ttft\",\"rounds\":$LAT_ROUNDS,\"prefill_ms\":${TMED[prefill]},\"decode_first_token_ms\":${TMED[decode]},\"nginx_prefill_ms\":${TMED[nginx]},$(for k in "${routers[@]}"; do printf '\"%s_ms\":%s,\"%s_added_ms\":%s,' "${k//-/_}" "${TMED[$k]}" "${k//-/_}" "${ADD[$k]}"; done)\"nginx_hop_ms\":${ADD[nginx]},\"nginx_decode_hop_ms\":${ADD[nginx-decode]}}" >>"$OUT/vllm.json"
fi

declare -A SDUR SFAIL
if [ "$STREAMS" -gt 0 ]; then
	for k in pdrouter vllm-router; do
		bench "${SPORT[$k]}" "$T/streams.json" --num-prompts "$STREAMS" --random-input-len 32 --random-output-len 16
		SDUR[$k]=$(field "$T/streams.json" duration)
		SFAIL[$k]=$(field "$T/streams.json" failed)
		echo "{\"row\":\"streams\",\"router\":\"$k\",\"streams\":$STREAMS,\"streams_failed\":${SFAIL[$k]},\"streams_s\":${SDUR[$k]}}" >>"$OUT/vllm.json"
	done
fi

ratio() { py "f'{$1/$2:.2f}' if $2 else '–'"; } # A B: A ÷ B
# cells MAP ROW: a row's cells (pdrouter, vllm-router, ratio; with BASE also base, pdrouter ÷ base)
cells() {
	local -n m=$1
	local p v
	p=$(echo "${m[$2-pdrouter]}" | median) v=$(echo "${m[$2-vllm-router]}" | median)
	printf '| %s | %s | ×%s |' "$p" "$v" "$(ratio "$p" "$v")"
	[ -z "$BASE" ] || { v=$(echo "${m[$2-base]}" | median); printf ' %s | ×%s |' "$v" "$(ratio "$p" "$v")"; }
}
more=
[ -z "$BASE" ] || more=" base ($BASE) | pdrouter ÷ base |"
echo "| vLLM PD, 1 prefill + 1 decode ($(date -u +%H:%M) UTC, load $(cut -d' ' -f1-3 /proc/loadavg)) | pdrouter | vllm-router 0.1.17 | ratio |$more"
echo "| --- | ---: | ---: | ---: |${more:+ ---: | ---: |}"
for engines in "${rows[@]}"; do
	label="${engines%-pinned} engines"
	[[ $engines == *-pinned ]] && label+=", router pinned to $(cores "$ROUTER_CPU"), engines and pdbench to $(cores "$LOAD_CPU")"
	echo "| $label: req/s, non-streamed, $CONC in flight (median of $ROUNDS) $(cells RPS "$engines")"
	echo "| $label: router CPU µs per request (median of $ROUNDS) $(cells CPU "$engines")"
	echo "| $label: the two engines' CPU µs per request, same rounds (median) $(cells ECPU "$engines")"
	share() { py "round($(echo "${CPU[$engines-$1]}" | median) * $(echo "${RPS[$engines-$1]}" | median) / 1e4)"; }
	line="| $label: the router's CPU in % of one core; $(cores "$ROUTER_CPU") / $(cores "$LOAD_CPU") busy % (medians) |"
	for k in "${routers[@]}"; do
		line+=" $(share "$k"); $(echo "${BUSY_R[$engines-$k]}" | median) / $(echo "${BUSY_L[$engines-$k]}" | median) |"
		[ "$k" = vllm-router ] && line+=" |"
	done
	echo "$line${BASE:+ |}"
done
if [ "$LAT_ROUNDS" -gt 0 ]; then
	b1= b2= b3=
	[ -z "$BASE" ] || b1=" ${TMED[base]} | |" b2=" ${ADD[base]} (${ASPREAD[base]}) | |" b3=" | |"
	cat <<EOF
| TTFT p50, mock prefill $SLOW_PREFILL + stub decode, $LAT_RATE req/s (ms; median of $LAT_ROUNDS rounds) | ${TMED[pdrouter]} | ${TMED[vllm-router]} | |$b1
| added by the router: TTFT − the prefill alone (${TMED[prefill]}) − the decode's first token alone (${TMED[decode]}), per round; median (rounds' min–max) | ${ADD[pdrouter]} (${ASPREAD[pdrouter]}) | ${ADD[vllm-router]} (${ASPREAD[vllm-router]}) | |$b2
| one nginx hop in front of the prefill, per round: nginx − the prefill alone; median (min–max) | ${ADD[nginx]} (${ASPREAD[nginx]}) | | |$b3
| one nginx hop in front of the decode (streamed, as the routers' replies), per round: nginx − the decode alone; median (min–max) | ${ADD[nginx-decode]} (${ASPREAD[nginx-decode]}) | | |$b3
EOF
fi
if [ "$STREAMS" -gt 0 ]; then
	echo "| $STREAMS streams at once (mocks, KV pulled): failed, seconds to the last | ${SFAIL[pdrouter]}, ${SDUR[pdrouter]} | ${SFAIL[vllm-router]}, ${SDUR[vllm-router]} | |${BASE:+ | |}"
fi
