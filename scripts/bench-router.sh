#!/usr/bin/env bash
# make bench: pdrouter against going straight to the backend and against nginx as a keep-alive
# reverse proxy, on zero-delay mockworkers, side by side in one run on this machine.
#
#   regular mode: wrk and pdbench → mockworker directly, → pdrouter, → nginx, → fastproxy (a bare
#                 fasthttp reverse proxy: what pdrouter's HTTP library costs before any router work)
#   PD mode:      pdrouter with 1 prefill + 1 decode and 2 + 2, against the decode worker directly
#                 and against nginx in front of the decode worker (the cost of one proxy hop here)
#   streams:      1,000 concurrent streams of 256 tokens through pdrouter (PD 1+1), no errors allowed
#
# Writes bench/out/router.json and the router section of bench/RESULTS.md.
# Knobs (environment): BIN (bin), WRK_SECS (9) and LAT_SECS (9) per target, split in ROUNDS (3),
# STREAMS (1000), STREAM_TOKENS (256).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-bin}
WRK_SECS=${WRK_SECS:-9}
LAT_SECS=${LAT_SECS:-9}
ROUNDS=${ROUNDS:-3}
STREAMS=${STREAMS:-1000}
STREAM_TOKENS=${STREAM_TOKENS:-256}
OUT=bench/out
for b in pdrouter mockworker pdbench fastproxy; do
	[ -x "$BIN/$b" ] || { echo "bench-router: $BIN/$b missing; run make build" >&2; exit 1; }
done
for c in nginx wrk; do
	command -v "$c" >/dev/null || { echo "bench-router: $c missing; run scripts/install-deps.sh bench" >&2; exit 1; }
done
mkdir -p "$OUT"
T=$(mktemp -d /tmp/bench-router.XXXXXX)
pids=()
cleanup() {
	for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
	for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
	rm -rf "$T"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
log() { echo "bench-router: $*" >&2; }

# free_port prints a loopback port nobody listens on, below the ephemeral range so that none of
# the benchmark's own client sockets can hold it.
free_port() {
	local p lo
	read -r lo _ </proc/sys/net/ipv4/ip_local_port_range
	while :; do
		p=$((10000 + RANDOM % (lo - 10000)))
		{ (exec 3<>"/dev/tcp/127.0.0.1/$p"); } 2>/dev/null || { echo "$p"; return; }
	done
}

# http_ok PORT PATH: a GET answered 200 (bash only, no curl needed).
http_ok() {
	{ exec 3<>"/dev/tcp/127.0.0.1/$1"; } 2>/dev/null || return 1
	printf 'GET %s HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n' "$2" >&3
	local status
	read -r -t 2 status <&3 || true
	exec 3<&-
	[[ $status == *" 200"* ]]
}

wait_ok() { # PORT PATH NAME LOG
	for _ in $(seq 200); do http_ok "$1" "$2" && return 0; sleep 0.05; done
	log "$3 on :$1 never answered $2; its log:"
	tail -n 20 "$4" >&2
	exit 1
}

# start_worker VAR ROLE [flags...]: starts a mockworker and sets VAR to its port. (Functions that
# start processes set variables instead of printing, since $(...) would run them in a subshell and
# lose their pids.)
start_worker() {
	local var=$1 role=$2 port
	shift 2
	port=$(free_port)
	"$BIN/mockworker" --role "$role" --port "$port" --tokens 8 --token-delay 0 "$@" >"$T/mw-$port.log" 2>&1 &
	pids+=($!)
	wait_ok "$port" /health "mockworker $role" "$T/mw-$port.log"
	printf -v "$var" %s "$port"
}

# start_router VAR ARGS...: starts pdrouter, waits until it is ready, sets VAR to its port and
# VAR_PID to its pid.
start_router() {
	local var=$1 port prom
	shift
	port=$(free_port)
	prom=$(free_port)
	"$BIN/pdrouter" --host 127.0.0.1 --port "$port" --prometheus-port "$prom" --policy round_robin \
		--log-level warn "$@" >"$T/router-$port.log" 2>&1 &
	pids+=($!)
	printf -v "${var}_PID" %s "$!"
	wait_ok "$port" /readiness pdrouter "$T/router-$port.log"
	printf -v "$var" %s "$port"
}

# cpu_ticks PID...: user+system clock ticks of those processes.
cpu_ticks() {
	local sum=0 p
	for p in "$@"; do sum=$((sum + $(awk '{print $14 + $15}' "/proc/$p/stat"))); done
	echo "$sum"
}
hwm_kib() { awk '/^VmHWM/ {print $2}' "/proc/$1/status"; }
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

# latency NAME URL RATE SECS [extra body]: one Poisson pdbench round, /generate streaming 8 tokens,
# appended to lat-NAME.jsonl.
latency() {
	local name=$1 url=$2 rate=$3 secs=$4 extra=${5:-}
	"$BIN/pdbench" --backend sglang --base-url "$url" --model mock --dataset-name random \
		--random-input-len 16 --random-output-len 8 --random-range-ratio 1 \
		--num-prompts "$(awk -v r="$rate" -v s="$secs" 'BEGIN {printf "%d", r * s}')" \
		--request-rate "$rate" --warmup-requests 64 --seed "$RANDOM" ${extra:+--extra-request-body "$extra"} \
		--output-file "$T/lat-$name.jsonl" >"$T/lat-$name.txt" 2>"$T/lat-$name.err" ||
		{ cat "$T/lat-$name.err" >&2; exit 1; }
}

GEN='{"text":"the quick brown fox jumps over the lazy dog","sampling_params":{"max_new_tokens":8},"stream":false}'
BOOT='"bootstrap_host":"127.0.0.1","bootstrap_port":8998,"bootstrap_room":1'
GEN_BOOT="${GEN%\}},$BOOT}"

LOAD_START=$(cut -d' ' -f1 /proc/loadavg)
log "starting mockworkers"
start_worker W regular
start_worker P1 prefill
start_worker D1 decode
start_worker P2 prefill
start_worker D2 decode

log "starting nginx and the routers"
NG=$(free_port)
NGD=$(free_port)
mkdir -p "$T/nginx"
cat >"$T/nginx/nginx.conf" <<EOF
user $(id -un);
daemon off;
worker_processes auto;
pid $T/nginx/nginx.pid;
error_log $T/nginx/error.log warn;
events { worker_connections 8192; }
http {
	access_log off;
	client_body_temp_path $T/nginx/body;
	proxy_temp_path $T/nginx/proxy;
	fastcgi_temp_path $T/nginx/fastcgi;
	uwsgi_temp_path $T/nginx/uwsgi;
	scgi_temp_path $T/nginx/scgi;
	upstream backend { server 127.0.0.1:$W; keepalive 256; }
	upstream decode { server 127.0.0.1:$D1; keepalive 256; }
	server {
		listen 127.0.0.1:$NG;
		location / {
			proxy_pass http://backend;
			proxy_http_version 1.1;
			proxy_set_header Connection "";
			proxy_buffering off;
		}
	}
	server {
		listen 127.0.0.1:$NGD;
		location / {
			proxy_pass http://decode;
			proxy_http_version 1.1;
			proxy_set_header Connection "";
			proxy_buffering off;
		}
	}
}
EOF
nginx -p "$T/nginx" -c "$T/nginx/nginx.conf" >"$T/nginx/stdout.log" 2>&1 &
NGINX_PID=$!
pids+=("$NGINX_PID")
wait_ok "$NG" /health nginx "$T/nginx/error.log"
NGINX_ALL=("$NGINX_PID" $(pgrep -P "$NGINX_PID"))

FP=$(free_port)
"$BIN/fastproxy" --listen "127.0.0.1:$FP" --backend "127.0.0.1:$W" >"$T/fastproxy.log" 2>&1 &
FASTPROXY_PID=$!
pids+=("$FASTPROXY_PID")
wait_ok "$FP" /health fastproxy "$T/fastproxy.log"

start_router RR --worker-urls "http://127.0.0.1:$W"
start_router PD1 --pd-disaggregation --prefill "http://127.0.0.1:$P1" 8998 --decode "http://127.0.0.1:$D1"
start_router PD2 --pd-disaggregation --prefill "http://127.0.0.1:$P1" 8998 \
	--prefill "http://127.0.0.1:$P2" 8998 --decode "http://127.0.0.1:$D1" --decode "http://127.0.0.1:$D2"

# The machine is shared and noisy, so every measurement runs in rounds that visit the targets in
# turn: a burst of load from elsewhere then hits all of them alike instead of one.
NAMES=(direct router nginx fast decode nginxd pd1 pd2)
declare -A URL=([direct]=$W [router]=$RR [nginx]=$NG [fast]=$FP [decode]=$D1 [nginxd]=$NGD [pd1]=$PD1 [pd2]=$PD2)
declare -A PROCS=([direct]="" [router]=$RR_PID [nginx]="${NGINX_ALL[*]}" [fast]=$FASTPROXY_PID [decode]="" [nginxd]="${NGINX_ALL[*]}" [pd1]=$PD1_PID [pd2]=$PD2_PID)
declare -A RPS REQS TICKS_USED
for n in "${NAMES[@]}"; do RPS[$n]=0 REQS[$n]=0 TICKS_USED[$n]=0; done
for round in $(seq "$ROUNDS"); do
	log "wrk round $round/$ROUNDS: -t1 -c64, $((WRK_SECS / ROUNDS))s per target, non-streamed 8-token /generate"
	for n in "${NAMES[@]}"; do
		body=$GEN
		[[ $n == decode || $n == nginxd ]] && body=$GEN_BOOT
		# shellcheck disable=SC2086 # PROCS holds a list of pids
		read -r rps reqs ticks < <(wrk_run $((WRK_SECS / ROUNDS)) "http://127.0.0.1:${URL[$n]}/generate" "$body" ${PROCS[$n]})
		# Noise only ever slows a run down, so the best round is the closest to the truth.
		((rps > RPS[$n])) && RPS[$n]=$rps
		REQS[$n]=$((REQS[$n] + reqs)) TICKS_USED[$n]=$((TICKS_USED[$n] + ticks))
	done
done
cpu_per_1k() { awk -v t="${TICKS_USED[$1]}" -v n="${REQS[$1]}" -v hz="$TICKS" 'BEGIN {printf "%.3f", (n > 0 ? t / hz / n * 1000 : 0)}'; }
WRK_DIRECT=${RPS[direct]} WRK_ROUTER=${RPS[router]} WRK_NGINX=${RPS[nginx]} WRK_FAST=${RPS[fast]}
WRK_DECODE=${RPS[decode]} WRK_NGINXD=${RPS[nginxd]} WRK_PD1=${RPS[pd1]} WRK_PD2=${RPS[pd2]}
CPU_ROUTER=$(cpu_per_1k router) CPU_NGINX=$(cpu_per_1k nginx) CPU_FAST=$(cpu_per_1k fast) CPU_NGINXD=$(cpu_per_1k nginxd) CPU_PD1=$(cpu_per_1k pd1) CPU_PD2=$(cpu_per_1k pd2)
log "req/s: direct $WRK_DIRECT, pdrouter $WRK_ROUTER, nginx $WRK_NGINX, fastproxy $WRK_FAST; decode direct $WRK_DECODE, nginx → decode $WRK_NGINXD, PD 1+1 $WRK_PD1, 2+2 $WRK_PD2"

# Latency at half the saturating rate. Saturation is measured as pdbench drives it (a closed loop
# of 64 against PD 1+1, the slowest path), not as wrk does: pdbench's client costs more CPU than
# wrk's and shares the same cores, so half of wrk's rate could already overload the machine.
"$BIN/pdbench" --backend sglang --base-url "http://127.0.0.1:$PD1" --model mock --random-input-len 16 \
	--random-output-len 8 --random-range-ratio 1 --num-prompts 20000 --max-concurrency 64 \
	--output-file "$T/cap.jsonl" >/dev/null 2>&1
CAP=$(jnum "$T/cap.jsonl" request_throughput)
RATE=$(awk -v c="$CAP" 'BEGIN {printf "%.0f", c / 2}')
for round in $(seq "$ROUNDS"); do
	log "pdbench round $round/$ROUNDS: Poisson $RATE req/s (PD 1+1 saturates at ${CAP%.*} under pdbench), $((LAT_SECS / ROUNDS))s per target"
	for n in "${NAMES[@]}"; do
		extra=""
		[[ $n == decode || $n == nginxd ]] && extra="{$BOOT}"
		latency "$n" "http://127.0.0.1:${URL[$n]}" "$RATE" $((LAT_SECS / ROUNDS)) "$extra"
	done
done
for n in "${NAMES[@]}"; do
	failed=$(jsum "$T/lat-$n.jsonl" failed)
	[ "$failed" = 0 ] || log "pdbench $n: $failed failed requests"
done

log "$STREAMS concurrent streams of $STREAM_TOKENS tokens through pdrouter (PD 1+1)"
start_worker SP prefill
start_worker SD decode --tokens "$STREAM_TOKENS" --token-delay 10ms
start_router SR --pd-disaggregation --prefill "http://127.0.0.1:$SP" 8998 --decode "http://127.0.0.1:$SD"
"$BIN/pdbench" --backend openai-chat --base-url "http://127.0.0.1:$SR" --model mock --random-input-len 32 \
	--random-output-len "$STREAM_TOKENS" --random-range-ratio 1 --num-prompts "$STREAMS" \
	--max-concurrency "$STREAMS" --output-file "$T/streams.jsonl" >"$T/streams.txt" 2>&1
ST_DONE=$(jnum "$T/streams.jsonl" completed)
ST_FAILED=$(jnum "$T/streams.jsonl" failed)
ST_TOKENS=$(jnum "$T/streams.jsonl" total_output_tokens)
ST_CONC=$(jnum "$T/streams.jsonl" concurrency)
ST_PEAK=$(jnum "$T/streams.jsonl" peak_concurrency)
ST_RSS=$(hwm_kib "$SR_PID")
RSS_ROUTER=$(hwm_kib "$RR_PID")
RSS_PD1=$(hwm_kib "$PD1_PID")
RSS_PD2=$(hwm_kib "$PD2_PID")
RSS_FAST=$(hwm_kib "$FASTPROXY_PID")
RSS_NGINX=0
for p in "${NGINX_ALL[@]}"; do RSS_NGINX=$((RSS_NGINX + $(hwm_kib "$p"))); done

# Everything measured; write bench/out/router.json and the RESULTS.md section.
LOAD_END=$(cut -d' ' -f1 /proc/loadavg)
# lat NAME KEY: the best round, since outside load only ever adds latency; counts are summed.
lat() {
	case $2 in
	completed | failed) jsum "$T/lat-$1.jsonl" "$2" ;;
	*) jmin "$T/lat-$1.jsonl" "$2" ;;
	esac
}
ratio() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%.2f", (b > 0 ? a / b : 0)}'; }
added_us() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%.0f", (a - b) * 1000}'; }
{
	echo "{"
	echo "  \"date\": \"$(date -u +%Y-%m-%dT%H:%M:%SZ)\", \"cpus\": $(nproc), \"load_average\": [$LOAD_START, $LOAD_END], \"wrk_secs\": $WRK_SECS, \"latency_rate\": $RATE, \"pd_1p1d_pdbench_saturation\": $CAP,"
	echo "  \"wrk_rps\": {\"direct\": $WRK_DIRECT, \"pdrouter\": $WRK_ROUTER, \"nginx\": $WRK_NGINX, \"fastproxy\": $WRK_FAST, \"decode_direct\": $WRK_DECODE, \"nginx_decode\": $WRK_NGINXD, \"pd_1p1d\": $WRK_PD1, \"pd_2p2d\": $WRK_PD2},"
	echo "  \"cpu_s_per_1k\": {\"pdrouter\": $CPU_ROUTER, \"nginx\": $CPU_NGINX, \"fastproxy\": $CPU_FAST, \"nginx_decode\": $CPU_NGINXD, \"pd_1p1d\": $CPU_PD1, \"pd_2p2d\": $CPU_PD2},"
	echo "  \"peak_rss_kib\": {\"pdrouter\": $RSS_ROUTER, \"nginx\": $RSS_NGINX, \"fastproxy\": $RSS_FAST, \"pd_1p1d\": $RSS_PD1, \"pd_2p2d\": $RSS_PD2, \"streams\": $ST_RSS},"
	echo "  \"latency_ms\": {"
	sep=""
	for n in "${NAMES[@]}"; do
		printf '%s    "%s": {"p50_e2e": %s, "p99_e2e": %s, "p50_ttft": %s, "p99_ttft": %s, "completed": %s, "failed": %s}' \
			"$sep" "$n" "$(lat $n median_e2e_latency_ms)" "$(lat $n p99_e2e_latency_ms)" "$(lat $n median_ttft_ms)" \
			"$(lat $n p99_ttft_ms)" "$(lat $n completed)" "$(lat $n failed)"
		sep=$',\n'
	done
	echo
	echo "  },"
	echo "  \"streams\": {\"streams\": $STREAMS, \"tokens\": $STREAM_TOKENS, \"completed\": $ST_DONE, \"failed\": $ST_FAILED, \"output_tokens\": $ST_TOKENS, \"achieved_concurrency\": $ST_CONC, \"peak_concurrency\": $ST_PEAK, \"router_peak_rss_kib\": $ST_RSS}"
	echo "}"
} >"$OUT/router.json"

row() { # name, rps, cpu, rss, base-for-latency, target-for-latency
	printf '| %s | %s | %s | %s | %s | %s | %s | %s |\n' "$1" "$2" "$3" "$(awk -v k="$4" 'BEGIN {printf "%.1f", k / 1024}')" \
		"$(lat "$6" median_e2e_latency_ms)" "$(lat "$6" p99_e2e_latency_ms)" \
		"$(added_us "$(lat "$6" median_e2e_latency_ms)" "$(lat "$5" median_e2e_latency_ms)")" \
		"$(added_us "$(lat "$6" p99_e2e_latency_ms)" "$(lat "$5" p99_e2e_latency_ms)")"
}
SECTION=$(
	cat <<EOF
Run $(date -u +%Y-%m-%d) on $(nproc) cores, mockworkers with zero token delay. Requests/s from \`wrk -t1 -c64\`
posting a non-streamed 8-token \`/generate\`, ${WRK_SECS} s per path; latency from pdbench, Poisson
arrivals of streamed 8-token \`/generate\` requests, ${LAT_SECS} s per path, at $RATE req/s: half the rate
at which a closed loop of 64 pdbench clients saturates PD 1P+1D. Each measurement runs in $ROUNDS rounds
that visit every path in turn, and the table shows each path's best round, since load from other
work on these shared cores only ever slows a round down (1-minute load average $LOAD_START at the
start, $LOAD_END at the end). Added latency is over the same backend reached directly (regular mode:
the worker; PD mode: the decode worker); the nginx → decode row is the same nginx in front of the
decode worker, what one keep-alive proxy hop costs on this machine; fastproxy is a reverse proxy
made of fasthttp alone (bench/fastproxy, no router work at all), the floor for a router built on
fasthttp and the Go runtime here. CPU is the proxy's user+system time per 1,000 wrk
requests (for nginx, all its processes); RSS is its peak (VmHWM).

| path | req/s | CPU s / 1k req | peak RSS MiB | p50 ms | p99 ms | added p50 µs | added p99 µs |
| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |
| direct → worker | $WRK_DIRECT | – | – | $(lat direct median_e2e_latency_ms) | $(lat direct p99_e2e_latency_ms) | – | – |
$(row "pdrouter (regular)" "$WRK_ROUTER" "$CPU_ROUTER" "$RSS_ROUTER" direct router)
$(row "nginx (keep-alive proxy)" "$WRK_NGINX" "$CPU_NGINX" "$RSS_NGINX" direct nginx)
$(row "fastproxy (bare fasthttp proxy)" "$WRK_FAST" "$CPU_FAST" "$RSS_FAST" direct fast)
| direct → decode worker | $WRK_DECODE | – | – | $(lat decode median_e2e_latency_ms) | $(lat decode p99_e2e_latency_ms) | – | – |
$(row "nginx → decode worker (one hop)" "$WRK_NGINXD" "$CPU_NGINXD" "$RSS_NGINX" decode nginxd)
$(row "pdrouter PD 1P+1D" "$WRK_PD1" "$CPU_PD1" "$RSS_PD1" decode pd1)
$(row "pdrouter PD 2P+2D" "$WRK_PD2" "$CPU_PD2" "$RSS_PD2" decode pd2)

Ratios: requests/s pdrouter / nginx **$(ratio "$WRK_ROUTER" "$WRK_NGINX")**, pdrouter / direct **$(ratio "$WRK_ROUTER" "$WRK_DIRECT")**,
pdrouter / fastproxy **$(ratio "$WRK_ROUTER" "$WRK_FAST")**, fastproxy / nginx **$(ratio "$WRK_FAST" "$WRK_NGINX")**,
PD 1P+1D / direct decode **$(ratio "$WRK_PD1" "$WRK_DECODE")**; CPU per request pdrouter / nginx **$(ratio "$CPU_ROUTER" "$CPU_NGINX")**,
fastproxy / nginx **$(ratio "$CPU_FAST" "$CPU_NGINX")**.
Added p50 latency: one nginx hop **$(added_us "$(lat nginxd median_e2e_latency_ms)" "$(lat decode median_e2e_latency_ms)") µs**, PD 1P+1D **$(added_us "$(lat pd1 median_e2e_latency_ms)" "$(lat decode median_e2e_latency_ms)") µs**.

Streams: $STREAMS concurrent streams of $STREAM_TOKENS tokens through pdrouter PD 1P+1D: $ST_DONE completed,
**$ST_FAILED errors**, $ST_TOKENS tokens, $ST_PEAK streams open at once at the peak (achieved
concurrency $ST_CONC), router peak RSS **$(awk -v k="$ST_RSS" 'BEGIN {printf "%.1f", k / 1024}') MiB**.
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
log "wrote $OUT/router.json and bench/RESULTS.md"
[ "$ST_FAILED" = 0 ] && [ "$ST_DONE" = "$STREAMS" ] || { log "streams: $ST_FAILED failed, $ST_DONE of $STREAMS completed"; exit 1; }
