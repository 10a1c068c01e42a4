#!/usr/bin/env bash
# make bench: pdrouter against the routers it replaces, sglang-router 0.3.2 and its successor smg
# 1.13.0 (pip, in a cached venv: scripts/bench-venv.sh), against going straight to the backend and
# against nginx as a keep-alive reverse proxy, all on the same zero-delay workers, side by side in
# one run on this machine.
#
# The requests/s and fixed-rate latency rows run on bench/stubengine, an engine stand-in that sends
# precomputed SGLang replies: the mockworker's net/http + encoding/json path costs ~4.5× a bare
# answer in CPU per request (~90 µs against ~20 on a quiet box), and with wrk, workers and router
# sharing 2 cores it took most of the CPU and compressed every router ratio (wrk also measures the
# mockworker directly, for scale). The slow-prefill and streams rows keep the mockworkers, which
# have the delay knobs.
#
#   regular mode: wrk and pdbench → the worker directly, → each router, → nginx, → fastproxy (a
#                 bare fasthttp reverse proxy: what pdrouter's HTTP library costs before any router
#                 work), → evproxy (an epoll event-loop proxy in Go built as nginx is: how near any
#                 Go design comes to nginx)
#   PD mode:      each router with 1 prefill + 1 decode and 2 + 2, against the decode worker
#                 directly and against nginx in front of the decode worker (one proxy hop)
#   latency:      p50/p99 TTFT and E2E of streamed requests at one fixed Poisson rate (LAT_RATE,
#                 below every router's saturation)
#   slow prefill: TTFT through each router in PD 1+1 when prefill answers after SLOW_PREFILL
#   streams:      STREAMS and BIG_STREAMS concurrent streams of STREAM_TOKENS tokens through each
#                 router in PD 1+1 (a fresh router for each run): errors, peak RSS, RSS per stream;
#                 pdrouter's big run reaches the workers over h2c (--upstream-http2), the others'
#                 over HTTP/1.1.
#                 The big run's streams arrive over a few seconds, since all at once would also
#                 hold a prefill socket each in the router (3N descriptors, not 2N), and its decode
#                 worker holds each stream's first token until they have all arrived.
#
# Every router gets the same flags: --host --port --prometheus-port --policy round_robin
# --log-level warn, and the workers (--worker-urls, or --pd-disaggregation --prefill URL 8998
# --decode URL). Writes bench/out/router.json and the router section of bench/RESULTS.md.
# Knobs (environment): BIN (bin); WRK_SECS (8) and LAT_SECS (8) per target, split in ROUNDS (4);
# LAT_RATE (800 req/s); SLOW_PREFILL (300ms); STREAMS (1000, opened at once), BIG_STREAMS (10000,
# opened at BIG_RATE 2000/s, first token after BIG_FIRST_TOKEN (twice the arrivals' time + 5 s),
# then BIG_TOKEN_DELAY 40ms apart, BIG_TIMEOUT 300s per stream), STREAM_TOKENS (256); RUST=0 leaves sglang-router and smg out (no venv, no network needed);
# WRK_ONLY=1 runs only the requests/s rounds and logs them with the ratios, writing no results.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-bin}
WRK_SECS=${WRK_SECS:-8}
LAT_SECS=${LAT_SECS:-8}
ROUNDS=${ROUNDS:-4}
LAT_RATE=${LAT_RATE:-800}
SLOW_PREFILL=${SLOW_PREFILL:-300ms}
STREAMS=${STREAMS:-1000}
BIG_STREAMS=${BIG_STREAMS:-10000}
BIG_RATE=${BIG_RATE:-2000}
BIG_TOKEN_DELAY=${BIG_TOKEN_DELAY:-40ms}
STREAM_TOKENS=${STREAM_TOKENS:-256}
RUST=${RUST:-1}
WRK_ONLY=${WRK_ONLY:-0}
OUT=bench/out
for b in pdrouter mockworker stubengine pdbench fastproxy evproxy; do
	[ -x "$BIN/$b" ] || { echo "bench-router: $BIN/$b missing; run make build" >&2; exit 1; }
done
for c in nginx wrk; do
	command -v "$c" >/dev/null || { echo "bench-router: $c missing; run scripts/install-deps.sh bench" >&2; exit 1; }
done
KINDS=(pdrouter)
if [ "$RUST" = 1 ]; then
	VENV=$(scripts/bench-venv.sh)
	KINDS+=(sglang smg)
fi
declare -A KIND_LABEL=([pdrouter]=pdrouter [sglang]=sglang-router [smg]=smg)

# Every PD request holds a client socket, a decode socket and, until prefill answers, a prefill
# socket in the router, so N clients need 3N file descriptors there, plus a reserve for listeners,
# probes and pooled idle sockets: pdrouter's default --max-connections is what the limit holds that
# way ((limit - min(max(limit/64, 64), 4096)) / 3 in PD mode, router/limits.go). Take the hard limit, and run
# that many big streams (in hundreds) if BIG_STREAMS do not fit (a process without
# CAP_SYS_RESOURCE cannot raise it; the run says so).
ulimit -n "$(ulimit -Hn)"
FD_LIMIT=$(ulimit -n)
FD_RESERVE=$((FD_LIMIT / 64 < 64 ? 64 : FD_LIMIT / 64 > 4096 ? 4096 : FD_LIMIT / 64))
BIG_FIT=$(((FD_LIMIT - FD_RESERVE) / 3 / 100 * 100))
BIG_RUN=$BIG_STREAMS
if ((BIG_STREAMS > BIG_FIT)); then
	BIG_RUN=$BIG_FIT
	echo "bench-router: open-file limit $FD_LIMIT (hard) holds $BIG_RUN streams, not $BIG_STREAMS" >&2
fi
# pdrouter's big run goes to the workers over h2c (--upstream-http2; the workers serve it beside
# HTTP/1.1): a stream holds its client's socket and a hundredth of an h2c connection per leg, and
# the default --max-connections admits that many (4 descriptors to spare per h2c worker).
BIG_FIT_H2C=$(((FD_LIMIT - FD_RESERVE - 8) * 100 / 102 / 100 * 100))
BIG_RUN_PD=$((BIG_STREAMS < BIG_FIT_H2C ? BIG_STREAMS : BIG_FIT_H2C))
((BIG_RUN_PD < BIG_STREAMS)) && echo "bench-router: open-file limit $FD_LIMIT (hard) holds $BIG_RUN_PD h2c streams, not $BIG_STREAMS" >&2
# The big run's decode worker sends each stream's head at once and its first token only after
# BIG_FIRST_TOKEN (as SGLang's decode waits for prefill's KV): tokens of the streams already open
# would otherwise take the 2 cores while the rest arrive, the worker would stop accepting, its
# listen queue overflow and the router's dials to it time out (connect errors, then its breaker).
BIG_FIRST_TOKEN=${BIG_FIRST_TOKEN:-$((2 * BIG_RUN_PD / BIG_RATE + 5))s}
BIG_TIMEOUT=${BIG_TIMEOUT:-300s}

mkdir -p "$OUT"
. scripts/bench-lib.sh
bench_setup bench-router

wait_ok() { # PORT PATH NAME LOG [SECONDS [PID]]
	local deadline=$((SECONDS + ${5:-10}))
	while ((SECONDS < deadline)); do
		http_ok "$1" "$2" && return 0
		[ -n "${6:-}" ] && ! kill -0 "$6" 2>/dev/null && break
		sleep 0.1
	done
	log "$3 on :$1 never answered $2; its log:"
	tail -n 20 "$4" >&2
	exit 1
}

# start_worker VAR ROLE [flags...]: starts a mockworker and sets VAR to its port and VAR_PID to its
# pid. (Functions that start processes set variables instead of printing, since $(...) would run
# them in a subshell and lose their pids.)
start_worker() {
	local var=$1 role=$2 port
	shift 2
	port=$(free_port)
	"$BIN/mockworker" --role "$role" --port "$port" --tokens 8 --token-delay 0 --record-requests -1 "$@" \
		>"$T/mw-$port.log" 2>&1 &
	pids+=($!)
	printf -v "${var}_PID" %s "$!"
	wait_ok "$port" /health "mockworker $role" "$T/mw-$port.log"
	printf -v "$var" %s "$port"
}
# start_stub VAR ROLE: the same with a stubengine (8 tokens, zero delay).
start_stub() {
	local var=$1 role=$2 port
	port=$(free_port)
	"$BIN/stubengine" --role "$role" --port "$port" --tokens 8 >"$T/stub-$port.log" 2>&1 &
	pids+=($!)
	printf -v "${var}_PID" %s "$!"
	wait_ok "$port" /health "stubengine $role" "$T/stub-$port.log"
	printf -v "$var" %s "$port"
}

# launch KIND VAR ARGS...: starts a router of KIND (pdrouter, sglang, smg) with the shared flags
# and ARGS, sets VAR to its port and VAR_PID to its pid; ready VAR waits until it answers.
# Launching them all before waiting lets the Python routers' slow start-up overlap.
launch() {
	local kind=$1 var=$2 port prom
	shift 2
	port=$(free_port)
	prom=$(free_port)
	local common=(--host 127.0.0.1 --port "$port" --prometheus-port "$prom" --policy round_robin --log-level warn "$@")
	case $kind in
	pdrouter) "$BIN/pdrouter" "${common[@]}" >"$T/router-$port.log" 2>&1 & ;;
	sglang) "$VENV/bin/python" -m sglang_router.launch_router "${common[@]}" >"$T/router-$port.log" 2>&1 & ;;
	# Not $VENV/bin/smg: sglang-router 0.3.2 installs a console script of that name too, and
	# whichever wheel pip installs last owns it (here 0.3.2's: "sgl-model-gateway 0.3.2").
	smg) "$VENV/bin/python" -m smg launch "${common[@]}" >"$T/router-$port.log" 2>&1 & ;;
	esac
	pids+=($!)
	printf -v "${var}_PID" %s "$!"
	printf -v "$var" %s "$port"
}
ready() {
	local port=${!1} pid
	pid=${1}_PID
	wait_ok "$port" /readiness "router $1" "$T/router-$port.log" 180 "${!pid}"
}

# cpu_ticks PID...: user+system clock ticks of those processes (threads included).
cpu_ticks() {
	local sum=0 p
	for p in "$@"; do sum=$((sum + $(awk '{print $14 + $15}' "/proc/$p/stat"))); done
	echo "$sum"
}
hwm_kib() { awk '/^VmHWM/ {print $2}' "/proc/$1/status"; }
rss_kib() { awk '/^VmRSS/ {print $2}' "/proc/$1/status"; }
TICKS=$(getconf CLK_TCK)

# wrk_run SECS URL BODY PID...: one wrk run; prints its req/s, its request count and the CPU
# clock ticks the given processes spent meanwhile.
wrk_run() {
	local secs=$1 url=$2 body=$3
	shift 3
	cat >"$T/post.lua" <<-EOF
		wrk.method = "POST"
		wrk.headers["Content-Type"] = "application/json"
		wrk.body = '$body'
	EOF
	local before after out
	before=$(cpu_ticks "$@")
	out=$(wrk -t1 -c64 -d"${secs}s" -s "$T/post.lua" "$url")
	after=$(cpu_ticks "$@")
	grep -qE 'Non-2xx|Socket errors' <<<"$out" && log "wrk $url: $(grep -E 'Non-2xx|Socket errors' <<<"$out")"
	echo "$(awk '/^Requests\/sec/ {printf "%.0f", $2}' <<<"$out") $(awk '/requests in/ {print $1}' <<<"$out") $((after - before))"
}

# jnum FILE KEY: a number from the last JSON line of a pdbench --output-file, to 3 decimals.
jnum() { tail -n1 "$1" | grep -o "\"$2\":[^,}]*" | cut -d: -f2 | awk '{printf "%.3f", $1}' | sed 's/\.000$//'; }

# jmin FILE KEY: the smallest KEY over every line (round) of a pdbench --output-file.
jmin() { grep -o "\"$2\":[^,}]*" "$1" | cut -d: -f2 | sort -g | head -n1 | awk '{printf "%.3f", $1}'; }

# jsum FILE KEY: the sum of KEY over every line.
jsum() { grep -o "\"$2\":[^,}]*" "$1" | cut -d: -f2 | awk '{s += $1} END {print s + 0}'; }

# latency NAME URL RATE SECS WARMUP [extra body]: one Poisson pdbench round, /generate streaming 8
# tokens, appended to lat-NAME.jsonl.
latency() {
	local name=$1 url=$2 rate=$3 secs=$4 warm=$5 extra=${6:-}
	"$BIN/pdbench" --backend sglang --base-url "$url" --model mock --dataset-name random \
		--random-input-len 16 --random-output-len 8 --random-range-ratio 1 \
		--num-prompts "$(awk -v r="$rate" -v s="$secs" 'BEGIN {printf "%d", r * s}')" \
		--request-rate "$rate" --warmup-requests "$warm" --seed "$RANDOM" ${extra:+--extra-request-body "$extra"} \
		--output-file "$T/lat-$name.jsonl" >"$T/lat-$name.txt" 2>"$T/lat-$name.err" ||
		{ cat "$T/lat-$name.err" >&2; exit 1; }
}

GEN='{"text":"the quick brown fox jumps over the lazy dog","sampling_params":{"max_new_tokens":8},"stream":false}'
BOOT='"bootstrap_host":"127.0.0.1","bootstrap_port":8998,"bootstrap_room":1'
GEN_BOOT="${GEN%\}},$BOOT}"

LOAD_START=$(cut -d' ' -f1 /proc/loadavg)
BENCH_START=$SECONDS
log "starting the workers (1-minute load average $LOAD_START)"
start_stub W regular
start_stub P1 prefill
start_stub D1 decode
start_stub P2 prefill
start_stub D2 decode
start_worker MW regular
start_worker SPP prefill --prefill-delay "$SLOW_PREFILL"
start_worker SPD decode
start_worker SP prefill --enable-http2
start_worker SD decode --tokens "$STREAM_TOKENS" --token-delay 10ms
start_worker SDB decode --tokens "$STREAM_TOKENS" --token-delay "$BIG_TOKEN_DELAY" --prefill-delay "$BIG_FIRST_TOKEN" --enable-http2

log "starting nginx and the routers: ${KINDS[*]}"
NG=$(free_port)
NGD=$(free_port)
start_nginx "$NG=$W" "$NGD=$D1"
wait_ok "$NG" /health nginx "$T/nginx/error.log"
NGINX_ALL=("$NGINX_PID" $(pgrep -P "$NGINX_PID"))

FP=$(free_port)
"$BIN/fastproxy" --listen "127.0.0.1:$FP" --backend "127.0.0.1:$W" >"$T/fastproxy.log" 2>&1 &
FASTPROXY_PID=$!
pids+=("$FASTPROXY_PID")
wait_ok "$FP" /health fastproxy "$T/fastproxy.log"
EP=$(free_port)
"$BIN/evproxy" --listen "127.0.0.1:$EP" --backend "127.0.0.1:$W" >"$T/evproxy.log" 2>&1 &
EVPROXY_PID=$!
pids+=("$EVPROXY_PID")
wait_ok "$EP" /health evproxy "$T/evproxy.log"

# Per kind: regular (K_reg), PD 1+1 (K_pd1), PD 2+2 (K_pd2), PD 1+1 on the slow prefill (K_slow),
# and one fresh PD 1+1 router for each streams run (K_st, K_big), so that its peak RSS is the
# run's alone.
ROUTERS=()
pd1=(--pd-disaggregation --prefill "http://127.0.0.1:$P1" 8998 --decode "http://127.0.0.1:$D1")
pd2=(--pd-disaggregation --prefill "http://127.0.0.1:$P1" 8998 --prefill "http://127.0.0.1:$P2" 8998
	--decode "http://127.0.0.1:$D1" --decode "http://127.0.0.1:$D2")
slow=(--pd-disaggregation --prefill "http://127.0.0.1:$SPP" 8998 --decode "http://127.0.0.1:$SPD")
streams=(--pd-disaggregation --prefill "http://127.0.0.1:$SP" 8998 --decode "http://127.0.0.1:$SD")
big=(--pd-disaggregation --prefill "http://127.0.0.1:$SP" 8998 --decode "http://127.0.0.1:$SDB")
for k in "${KINDS[@]}"; do
	launch "$k" "${k}_reg" --worker-urls "http://127.0.0.1:$W"
	launch "$k" "${k}_pd1" "${pd1[@]}"
	launch "$k" "${k}_pd2" "${pd2[@]}"
	ROUTERS+=("${k}_reg" "${k}_pd1" "${k}_pd2")
	[ "$WRK_ONLY" = 1 ] && continue
	launch "$k" "${k}_slow" "${slow[@]}"
	launch "$k" "${k}_st" "${streams[@]}"
	if [ "$k" = pdrouter ]; then launch "$k" "${k}_big" "${big[@]}" --upstream-http2; else launch "$k" "${k}_big" "${big[@]}"; fi
	ROUTERS+=("${k}_slow" "${k}_st" "${k}_big")
done
for r in "${ROUTERS[@]}"; do ready "$r"; done
log "all routers ready after $((SECONDS - BENCH_START)) s"

# The machine is shared and noisy, so every measurement runs in rounds that visit the targets in
# turn: a burst of load from elsewhere then hits all of them alike instead of one.
NAMES=(direct nginx fast ev decode nginxd)
declare -A URL=([direct]=$W [nginx]=$NG [fast]=$FP [ev]=$EP [decode]=$D1 [nginxd]=$NGD)
declare -A PROCS=([direct]="" [nginx]="${NGINX_ALL[*]}" [fast]=$FASTPROXY_PID [ev]=$EVPROXY_PID [decode]="" [nginxd]="${NGINX_ALL[*]}")
declare -A PD_BODY=([decode]=1 [nginxd]=1)
for k in "${KINDS[@]}"; do
	for m in reg pd1 pd2; do
		n=${k}_$m port=${k}_$m pid=${k}_${m}_PID
		NAMES+=("$n")
		URL[$n]=${!port} PROCS[$n]=${!pid}
	done
done
# The engines themselves, measured direct under wrk only: the stub (direct) and the mockworker it
# replaces (mockw), with their own CPU per request (ENGINE_TICKS), so the run shows what the
# mockworker would have taken from the routers' share of the cores.
URL[mockw]=$MW
declare -A ENGINE_PID=([direct]=$W_PID [mockw]=$MW_PID)
declare -A RPS REQS TICKS_USED ENGINE_TICKS
for n in "${NAMES[@]}" mockw; do RPS[$n]=0 REQS[$n]=0 TICKS_USED[$n]=0 ENGINE_TICKS[$n]=0; done
for round in $(seq "$ROUNDS"); do
	log "wrk round $round/$ROUNDS: -t1 -c64, $((WRK_SECS / ROUNDS))s per target, non-streamed 8-token /generate"
	for n in "${NAMES[@]}" mockw; do
		body=$GEN
		[ -n "${PD_BODY[$n]:-}" ] && body=$GEN_BOOT
		if [ -n "${ENGINE_PID[$n]:-}" ]; then
			read -r rps reqs ticks < <(wrk_run $((WRK_SECS / ROUNDS)) "http://127.0.0.1:${URL[$n]}/generate" "$body" "${ENGINE_PID[$n]}")
			((rps > RPS[$n])) && RPS[$n]=$rps
			REQS[$n]=$((REQS[$n] + reqs)) ENGINE_TICKS[$n]=$((ENGINE_TICKS[$n] + ticks))
			continue
		fi
		# shellcheck disable=SC2086 # PROCS holds a list of pids
		read -r rps reqs ticks < <(wrk_run $((WRK_SECS / ROUNDS)) "http://127.0.0.1:${URL[$n]}/generate" "$body" ${PROCS[$n]})
		# Noise only ever slows a run down, so the best round is the closest to the truth.
		((rps > RPS[$n])) && RPS[$n]=$rps
		REQS[$n]=$((REQS[$n] + reqs)) TICKS_USED[$n]=$((TICKS_USED[$n] + ticks))
	done
done
# cpu_us NAME: the proxy's CPU per wrk request, µs; engine_us NAME: the engine's, for direct and mockw.
per_req_us() { awk -v t="$1" -v n="$2" -v hz="$TICKS" 'BEGIN {printf "%.1f", (n > 0 ? t / hz / n * 1e6 : 0)}'; }
cpu_us() { per_req_us "${TICKS_USED[$1]}" "${REQS[$1]}"; }
engine_us() { per_req_us "${ENGINE_TICKS[$1]}" "${REQS[$1]}"; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN {if (b > 0) printf "%.2f", a / b; else printf "–"}'; }
log "req/s: $(for n in "${NAMES[@]}" mockw; do printf '%s %s, ' "$n" "${RPS[$n]}"; done)"
log "engine CPU µs/req under wrk: stubengine $(engine_us direct), mockworker $(engine_us mockw)"
if [ "$WRK_ONLY" = 1 ]; then
	log "proxy CPU µs/req: $(for n in "${NAMES[@]}"; do [ -n "${PROCS[$n]}" ] && printf '%s %s, ' "$n" "$(cpu_us "$n")"; done)"
	log "req/s / nginx: pdrouter $(ratio "${RPS[pdrouter_reg]}" "${RPS[nginx]}"), fastproxy $(ratio "${RPS[fast]}" "${RPS[nginx]}"), evproxy $(ratio "${RPS[ev]}" "${RPS[nginx]}")"
	for k in "${KINDS[@]:1}"; do
		log "pdrouter / ${KIND_LABEL[$k]} req/s: regular $(ratio "${RPS[pdrouter_reg]}" "${RPS[${k}_reg]}"), PD 1+1 $(ratio "${RPS[pdrouter_pd1]}" "${RPS[${k}_pd1]}"), PD 2+2 $(ratio "${RPS[pdrouter_pd2]}" "${RPS[${k}_pd2]}")"
	done
	log "WRK_ONLY=1: done after $((SECONDS - BENCH_START)) s, nothing written"
	exit 0
fi
for n in "${NAMES[@]}"; do
	if [[ $n == *_* ]] && ((RPS[$n] < 2 * LAT_RATE)); then
		log "$n saturates at ${RPS[$n]} req/s under wrk: LAT_RATE $LAT_RATE is not well below it"
	fi
done

for round in $(seq "$ROUNDS"); do
	log "pdbench round $round/$ROUNDS: Poisson $LAT_RATE req/s, $((LAT_SECS / ROUNDS))s per target"
	for n in "${NAMES[@]}"; do
		extra=""
		[ -n "${PD_BODY[$n]:-}" ] && extra="{$BOOT}"
		latency "$n" "http://127.0.0.1:${URL[$n]}" "$LAT_RATE" $((LAT_SECS / ROUNDS)) 64 "$extra"
	done
done
for n in "${NAMES[@]}"; do
	failed=$(jsum "$T/lat-$n.jsonl" failed)
	[ "$failed" = 0 ] || log "pdbench $n: $failed failed requests"
done

log "slow prefill ($SLOW_PREFILL): TTFT through each router, PD 1+1"
for k in "${KINDS[@]}"; do
	port=${k}_slow
	latency "${k}_slow" "http://127.0.0.1:${!port}" 50 4 8
done

# streams KIND KEY N RATE: N concurrent streams through KIND's fresh router K_KEY, arriving at
# RATE per second (inf: all at once). The big run sends no warm-up stream (it would take a whole
# stream's time) and gives each stream BIG_TIMEOUT: 2 cores relay N x STREAM_TOKENS events in
# well over a minute, whatever the token delay.
# While they run, a sampler counts the router's open descriptors every 0.1 s.
declare -A ST_DONE ST_FAILED ST_PEAK ST_RSS ST_IDLE ST_SECS ST_IDLE_FDS ST_PEAK_FDS
fd_count() { ls "/proc/$1/fd" 2>/dev/null | wc -l; }
streams() {
	local kind=$1 key=$2 n=$3 rate=$4 port pid start sampler warm=1 timeout=120s
	[ "$key" = big ] && warm=0 timeout=$BIG_TIMEOUT
	port=${kind}_$key pid=${kind}_${key}_PID
	ST_IDLE[$kind$key]=$(rss_kib "${!pid}")
	ST_IDLE_FDS[$kind$key]=$(fd_count "${!pid}")
	log "$n concurrent streams of $STREAM_TOKENS tokens through ${KIND_LABEL[$kind]} (PD 1+1)"
	start=$SECONDS
	(while [ ! -e "$T/fds-$kind$key.stop" ]; do fd_count "${!pid}"; sleep 0.1; done >"$T/fds-$kind$key") &
	sampler=$!
	"$BIN/pdbench" --backend openai-chat --base-url "http://127.0.0.1:${!port}" --model mock --random-input-len 32 \
		--random-output-len "$STREAM_TOKENS" --random-range-ratio 1 --num-prompts "$n" --max-concurrency "$n" \
		--warmup-requests "$warm" --request-rate "$rate" --request-timeout "$timeout" --output-file "$T/streams-$kind$key.jsonl" >"$T/streams-$kind$key.txt" 2>&1 ||
		log "pdbench streams through $kind failed: $(tail -n 3 "$T/streams-$kind$key.txt")"
	ST_SECS[$kind$key]=$((SECONDS - start))
	touch "$T/fds-$kind$key.stop"
	wait "$sampler" || true
	ST_PEAK_FDS[$kind$key]=$(sort -n "$T/fds-$kind$key" | tail -n1)
	if [ -s "$T/streams-$kind$key.jsonl" ]; then
		ST_DONE[$kind$key]=$(jnum "$T/streams-$kind$key.jsonl" completed)
		ST_FAILED[$kind$key]=$(jnum "$T/streams-$kind$key.jsonl" failed)
		ST_PEAK[$kind$key]=$(jnum "$T/streams-$kind$key.jsonl" peak_concurrency)
	else
		ST_DONE[$kind$key]=0 ST_FAILED[$kind$key]=$n ST_PEAK[$kind$key]=0
	fi
	ST_RSS[$kind$key]=$(hwm_kib "${!pid}")
	if [ "${ST_FAILED[$kind$key]}" != 0 ]; then
		log "$kind: ${ST_FAILED[$kind$key]} of $n streams failed: $(grep -A3 '^Failed requests' "$T/streams-$kind$key.txt" | grep '^  ' | tr -s ' ' | tr '\n' ';')"
	fi
}
for k in "${KINDS[@]}"; do streams "$k" st "$STREAMS" inf; done
big_run() { if [ "$1" = pdrouter ]; then echo "$BIG_RUN_PD"; else echo "$BIG_RUN"; fi; }
for k in "${KINDS[@]}"; do streams "$k" big "$(big_run "$k")" "$BIG_RATE"; done

declare -A RSS
for k in "${KINDS[@]}"; do
	for m in reg pd1 pd2; do
		pid=${k}_${m}_PID
		RSS[${k}_$m]=$(hwm_kib "${!pid}")
	done
done
RSS[fast]=$(hwm_kib "$FASTPROXY_PID")
RSS[ev]=$(hwm_kib "$EVPROXY_PID")
RSS[nginx]=0
for p in "${NGINX_ALL[@]}"; do RSS[nginx]=$((RSS[nginx] + $(hwm_kib "$p"))); done
RSS[nginxd]=${RSS[nginx]}

# Everything measured; write bench/out/router.json and the RESULTS.md section.
LOAD_END=$(cut -d' ' -f1 /proc/loadavg)
ELAPSED=$((SECONDS - BENCH_START))
# lat NAME KEY: the best round, since outside load only ever adds latency; counts are summed.
lat() {
	case $2 in
	completed | failed) jsum "$T/lat-$1.jsonl" "$2" ;;
	*) jmin "$T/lat-$1.jsonl" "$2" ;;
	esac
}
added_us() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%.0f", (a - b) * 1000}'; }
mib() { awk -v k="$1" 'BEGIN {printf "%.1f", k / 1024}'; }
# per_stream_kib KEY: RSS over idle at the peak per stream open at the peak (fewer than asked for
# when some failed).
per_stream_kib() { awk -v h="${ST_RSS[$1]}" -v i="${ST_IDLE[$1]}" -v n="${ST_PEAK[$1]:-0}" 'BEGIN {printf "%.1f", (n > 0 ? (h - i) / n : 0)}'; }
# fds_per_stream KEY: descriptors the router held at its peak beyond idle, per stream open at the peak.
fds_per_stream() { awk -v p="${ST_PEAK_FDS[$1]:-0}" -v i="${ST_IDLE_FDS[$1]:-0}" -v n="${ST_PEAK[$1]:-0}" 'BEGIN {printf "%.2f", (n > 0 ? (p - i) / n : 0)}'; }
{
	echo "{"
	echo "  \"date\": \"$(date -u +%Y-%m-%dT%H:%M:%SZ)\", \"cpus\": $(nproc), \"load_average\": [$LOAD_START, $LOAD_END], \"seconds\": $ELAPSED,"
	echo "  \"engines\": {\"stubengine\": {\"rps\": ${RPS[direct]}, \"cpu_us_per_req\": $(engine_us direct)}, \"mockworker\": {\"rps\": ${RPS[mockw]}, \"cpu_us_per_req\": $(engine_us mockw)}},"
	echo "  \"wrk_secs\": $WRK_SECS, \"rounds\": $ROUNDS, \"latency_rate\": $LAT_RATE, \"slow_prefill\": \"$SLOW_PREFILL\", \"open_file_limit\": $FD_LIMIT,"
	echo "  \"paths\": {"
	sep=""
	for n in "${NAMES[@]}"; do
		printf '%s    "%s": {"rps": %s, "cpu_us_per_req": %s, "peak_rss_kib": %s, "p50_ttft_ms": %s, "p99_ttft_ms": %s, "p50_e2e_ms": %s, "p99_e2e_ms": %s, "completed": %s, "failed": %s}' \
			"$sep" "$n" "${RPS[$n]}" "$(cpu_us "$n")" "${RSS[$n]:-0}" "$(lat "$n" median_ttft_ms)" "$(lat "$n" p99_ttft_ms)" \
			"$(lat "$n" median_e2e_latency_ms)" "$(lat "$n" p99_e2e_latency_ms)" "$(lat "$n" completed)" "$(lat "$n" failed)"
		sep=$',\n'
	done
	echo
	echo "  },"
	echo "  \"slow_prefill_ms\": {"
	sep=""
	for k in "${KINDS[@]}"; do
		printf '%s    "%s": {"p50_ttft": %s, "p99_ttft": %s, "p50_e2e": %s, "completed": %s, "failed": %s}' "$sep" "$k" \
			"$(lat "${k}_slow" median_ttft_ms)" "$(lat "${k}_slow" p99_ttft_ms)" "$(lat "${k}_slow" median_e2e_latency_ms)" \
			"$(lat "${k}_slow" completed)" "$(lat "${k}_slow" failed)"
		sep=$',\n'
	done
	echo
	echo "  },"
	echo "  \"streams\": {"
	sep=""
	for k in "${KINDS[@]}"; do
		for key in st big; do
			n=$STREAMS
			[ $key = big ] && n=$(big_run "$k")
			printf '%s    "%s_%s": {"streams": %s, "tokens": %s, "completed": %s, "failed": %s, "peak_concurrency": %s, "seconds": %s, "idle_rss_kib": %s, "peak_rss_kib": %s, "kib_per_stream": %s, "idle_fds": %s, "peak_fds": %s, "fds_per_stream": %s}' \
				"$sep" "$k" "$n" "$n" "$STREAM_TOKENS" "${ST_DONE[$k$key]}" "${ST_FAILED[$k$key]}" "${ST_PEAK[$k$key]}" \
				"${ST_SECS[$k$key]}" "${ST_IDLE[$k$key]}" "${ST_RSS[$k$key]}" "$(per_stream_kib "$k$key")" \
				"${ST_IDLE_FDS[$k$key]}" "${ST_PEAK_FDS[$k$key]}" "$(fds_per_stream "$k$key")"
			sep=$',\n'
		done
	done
	echo
	echo "  }"
	echo "}"
} >"$OUT/router.json"

# path_row LABEL NAME BASE: one row of the paths table; BASE is what added TTFT is measured over.
path_row() {
	local cpu="–" rss="–" added="–"
	[ "${PROCS[$2]}" != "" ] && cpu=$(cpu_us "$2")
	[ -n "${RSS[$2]:-}" ] && rss=$(mib "${RSS[$2]}")
	[ -n "$3" ] && added=$(added_us "$(lat "$2" median_ttft_ms)" "$(lat "$3" median_ttft_ms)")
	printf '| %s | %s | %s | %s | %s | %s | %s | %s | %s |\n' "$1" "${RPS[$2]}" "$cpu" "$rss" \
		"$(lat "$2" median_ttft_ms)" "$(lat "$2" p99_ttft_ms)" "$(lat "$2" median_e2e_latency_ms)" \
		"$(lat "$2" p99_e2e_latency_ms)" "$added"
}
# cmp_row LABEL VALUE-FUNCTION ARG: a row of the comparison table, value per kind and the ratios
# pdrouter / each other kind.
cmp_row() {
	local label=$1 fn=$2 arg=$3 k line mine
	mine=$($fn pdrouter "$arg")
	line="| $label | $mine"
	for k in "${KINDS[@]:1}"; do line+=" | $($fn "$k" "$arg")"; done
	for k in "${KINDS[@]:1}"; do line+=" | **$(ratio "$mine" "$($fn "$k" "$arg")")**"; done
	echo "$line |"
}
v_rps() { echo "${RPS[${1}_$2]}"; }
v_cpu() { cpu_us "${1}_$2"; }
v_lat() { lat "${1}_${2%:*}" "${2#*:}"; }
v_rss() { mib "${RSS[${1}_$2]}"; }
v_strss() { mib "${ST_RSS[$1$2]}"; }
v_stfail() { echo "${ST_FAILED[$1$2]}"; }
v_stper() { per_stream_kib "$1$2"; }
v_stfds() { echo "${ST_PEAK_FDS[$1$2]}"; }
v_stfdper() { fds_per_stream "$1$2"; }
met() { awk -v a="$1" -v b="$2" 'BEGIN {print (a >= b ? "met" : "not met")}'; }

heads="| metric | pdrouter"
for k in "${KINDS[@]:1}"; do heads+=" | ${KIND_LABEL[$k]}"; done
for k in "${KINDS[@]:1}"; do heads+=" | pdrouter / ${KIND_LABEL[$k]}"; done
aligns="| --- | ---:"
for _ in "${KINDS[@]:1}" "${KINDS[@]:1}"; do aligns+=" | ---:"; done
TTFT_ROUTER=$(added_us "$(lat pdrouter_reg median_ttft_ms)" "$(lat direct median_ttft_ms)")
TTFT_NGINX=$(added_us "$(lat nginx median_ttft_ms)" "$(lat direct median_ttft_ms)")
BIG_RSS=$(mib "${ST_RSS[pdrouterbig]}")
targets="Targets (issue 14):"
if [ "$RUST" = 1 ]; then
	targets+=" PD 1P+1D req/s ≥ 3× smg's: **$(ratio "${RPS[pdrouter_pd1]}" "${RPS[smg_pd1]}")×, $(met "$(ratio "${RPS[pdrouter_pd1]}" "${RPS[smg_pd1]}")" 3)**;"
	targets+=" regular ≥ 3× smg's: **$(ratio "${RPS[pdrouter_reg]}" "${RPS[smg_reg]}")×, $(met "$(ratio "${RPS[pdrouter_reg]}" "${RPS[smg_reg]}")" 3)**;"
fi
targets+=" added p50 TTFT over direct ≤ one nginx hop's: **$TTFT_ROUTER µs vs $TTFT_NGINX µs, $(met "$TTFT_NGINX" "$TTFT_ROUTER")**;"
targets+=" $BIG_STREAMS streams with 0 errors and router RSS ≤ 160 MiB: **$BIG_RUN_PD run, ${ST_FAILED[pdrouterbig]} errors, $BIG_RSS MiB**"
if ((BIG_RUN_PD < BIG_STREAMS)); then
	# Each open stream holds at least its client and decode sockets in the router, more while its
	# prefill leg is open; RSS extrapolated from the big run's per-stream figure.
	targets+=" (not met as stated: the router held $(fds_per_stream pdrouterbig) descriptors per open stream at its peak"
	targets+=" (${ST_PEAK_FDS[pdrouterbig]} for ${ST_PEAK[pdrouterbig]} open), and this machine's hard open-file limit, $FD_LIMIT"
	targets+=" (not raisable without CAP_SYS_RESOURCE), admits $BIG_RUN_PD h2c streams through the default --max-connections;"
	targets+=" at $(per_stream_kib pdrouterbig) KiB per stream, 10000 streams would take"
	targets+=" $(awk -v i="${ST_IDLE[pdrouterbig]}" -v k="$(per_stream_kib pdrouterbig)" 'BEGIN {printf "%.0f", (i + 10000 * k) / 1024}') MiB)."
else
	targets+=", $([ "${ST_FAILED[pdrouterbig]}" = 0 ] && met 160 "$BIG_RSS" || echo "not met")."
fi

SECTION=$(
	cat <<EOF
Run $(date -u '+%Y-%m-%d %H:%M') UTC on $(nproc) cores (1-minute load average $LOAD_START at the start, $LOAD_END at
the end; the cores are shared with other work), $ELAPSED s in all. The requests/s and latency rows
run on bench/stubengine (precomputed SGLang replies, zero delay), not on the mockworker, since the
mockworker's CPU per request is several times a bare answer's and, on cores shared by wrk, workers
and router, it took most of the CPU and compressed every router ratio (in this run, direct under
wrk: stub $(engine_us direct) µs of CPU per request at ${RPS[direct]} req/s, mockworker $(engine_us mockw) µs at ${RPS[mockw]} req/s,
$(ratio "$(engine_us mockw)" "$(engine_us direct)")× the CPU). The slow-prefill and streams rows keep the zero-delay mockworkers, which have
the delay knobs. Requests/s from \`wrk -t1 -c64\` posting a non-streamed 8-token \`/generate\`, ${WRK_SECS} s per path;
TTFT and E2E from pdbench, Poisson arrivals of streamed 8-token \`/generate\` requests at a fixed
$LAT_RATE req/s, ${LAT_SECS} s per path. Each measurement runs in $ROUNDS rounds that visit every path in
turn, and the table shows each path's best round, since load from other work only ever slows a
round down. Every router runs with the same flags (\`--policy round_robin\`, the same workers);
sglang-router 0.3.2 and smg 1.13.0 come from PyPI (scripts/bench-venv.sh). Added TTFT is over the
same backend reached directly (regular: the worker; PD: the decode worker); nginx → decode is
what one keep-alive proxy hop costs here; fastproxy is a bare fasthttp reverse proxy
(bench/fastproxy), evproxy an epoll event-loop proxy in Go built as nginx is (bench/evproxy). CPU is the proxy's user+system time per wrk request (nginx: all its
processes); RSS is its peak (VmHWM) after the wrk and latency rounds.

| path | req/s | CPU µs/req | peak RSS MiB | p50 TTFT ms | p99 TTFT ms | p50 E2E ms | p99 E2E ms | added p50 TTFT µs |
| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |
$(path_row "direct → worker" direct "")
$(for k in "${KINDS[@]}"; do path_row "${KIND_LABEL[$k]} (regular)" "${k}_reg" direct; done)
$(path_row "nginx (keep-alive proxy)" nginx direct)
$(path_row "fastproxy (bare fasthttp proxy)" fast direct)
$(path_row "evproxy (epoll event-loop Go proxy)" ev direct)
$(path_row "direct → decode worker" decode "")
$(path_row "nginx → decode worker (one hop)" nginxd decode)
$(for k in "${KINDS[@]}"; do path_row "${KIND_LABEL[$k]} PD 1P+1D" "${k}_pd1" decode; path_row "${KIND_LABEL[$k]} PD 2P+2D" "${k}_pd2" decode; done)

Slow prefill: PD 1P+1D with a prefill worker that answers after $SLOW_PREFILL, streamed requests at 50 req/s for 4 s
(a router that waits for prefill before relaying decode's stream adds the whole delay to TTFT).
Streams: a fresh PD 1P+1D router per run, $STREAM_TOKENS tokens per stream; $STREAMS streams opened at once with tokens
10 ms apart, $BIG_RUN_PD through pdrouter (to the workers over h2c, \`--upstream-http2\`) and $BIG_RUN through each other router (HTTP/1.1) opened at $BIG_RATE/s, each with its first token after $BIG_FIRST_TOKEN and the rest $BIG_TOKEN_DELAY apart (so that all are open together, while the
prefill sockets of the ones arriving stay few and the decode worker is not generating while they arrive). RSS per stream is (peak − idle RSS) / streams open at the peak, descriptors per stream likewise.

$heads |
$aligns |
$(cmp_row "req/s, regular" v_rps reg)
$(cmp_row "req/s, PD 1P+1D" v_rps pd1)
$(cmp_row "req/s, PD 2P+2D" v_rps pd2)
$(cmp_row "CPU µs/req, regular" v_cpu reg)
$(cmp_row "CPU µs/req, PD 1P+1D" v_cpu pd1)
$(cmp_row "p50 TTFT ms, regular" v_lat reg:median_ttft_ms)
$(cmp_row "p99 TTFT ms, regular" v_lat reg:p99_ttft_ms)
$(cmp_row "p50 TTFT ms, PD 1P+1D" v_lat pd1:median_ttft_ms)
$(cmp_row "p99 TTFT ms, PD 1P+1D" v_lat pd1:p99_ttft_ms)
$(cmp_row "p50 E2E ms, PD 1P+1D" v_lat pd1:median_e2e_latency_ms)
$(cmp_row "p50 TTFT ms, slow prefill" v_lat slow:median_ttft_ms)
$(cmp_row "peak RSS MiB, regular" v_rss reg)
$(cmp_row "peak RSS MiB, PD 1P+1D" v_rss pd1)
$(cmp_row "$STREAMS streams: errors" v_stfail st)
$(cmp_row "$STREAMS streams: peak RSS MiB" v_strss st)
$(cmp_row "$STREAMS streams: KiB per stream" v_stper st)
$(cmp_row "big run streams: errors" v_stfail big)
$(cmp_row "big run streams: peak RSS MiB" v_strss big)
$(cmp_row "big run streams: KiB per stream" v_stper big)
$(cmp_row "big run streams: peak open descriptors" v_stfds big)
$(cmp_row "big run streams: descriptors per open stream" v_stfdper big)

(For times, CPU and memory a ratio below 1 is pdrouter's advantage; for req/s, above 1.)
Streams completed: $(for k in "${KINDS[@]}"; do printf '%s %s/%s and %s/%s (peak %s and %s open at once, %s s and %s s). ' "${KIND_LABEL[$k]}" "${ST_DONE[${k}st]}" "$STREAMS" "${ST_DONE[${k}big]}" "$(big_run "$k")" "${ST_PEAK[${k}st]}" "${ST_PEAK[${k}big]}" "${ST_SECS[${k}st]}" "${ST_SECS[${k}big]}"; done)
$targets
EOF
)
# Replace what lies between the router markers, leaving the rest of the file alone.
printf '%s\n' "$SECTION" >"$T/section.md"
awk -v section="$T/section.md" '
	/<!-- BEGIN router -->/ {print; while ((getline line <section) > 0) print line; skip = 1; next}
	/<!-- END router -->/ {skip = 0}
	!skip {print}
' bench/RESULTS.md >"$T/RESULTS.md"
cp "$T/RESULTS.md" bench/RESULTS.md
echo "$SECTION"
log "wrote $OUT/router.json and bench/RESULTS.md in $ELAPSED s"
[ "${ST_FAILED[pdrouterst]}" = 0 ] && [ "${ST_DONE[pdrouterst]}" = "$STREAMS" ] ||
	{ log "streams: ${ST_FAILED[pdrouterst]} failed, ${ST_DONE[pdrouterst]} of $STREAMS completed"; exit 1; }
