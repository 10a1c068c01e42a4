#!/usr/bin/env bash
# make run: a local PD deployment on one machine. The router listens on
# :8000 (metrics on :29000) in front of one prefill and one decode mock
# engine. Each engine allocates its KV pool itself (a memfd) and registers
# it with its kvproxy, as SGLang does; the kvproxies move the KV between
# the engines' memory over shm (one host, the default), or tcp or ucx:
#
#   scripts/run-local.sh [--transport shm|tcp|ucx]   (or KV_TRANSPORT=...)
#
# It says ready once the router answers /readiness with 200. If a port is
# taken or a process exits, it says which and why and exits non-zero.
# Ctrl-C stops everything.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-bin}
PREFILL_PORT=${PREFILL_PORT:-30001}
DECODE_PORT=${DECODE_PORT:-30002}
BOOTSTRAP_PORT=${BOOTSTRAP_PORT:-8998}
ROUTER_PORT=${ROUTER_PORT:-8000}
ROUTER_METRICS_PORT=${ROUTER_METRICS_PORT:-29000}
KVP_METRICS_PORT=${KVP_METRICS_PORT:-29101}
KVD_METRICS_PORT=${KVD_METRICS_PORT:-29102}
READY_TIMEOUT=${READY_TIMEOUT:-60}
# Each engine's KV pool in tokens (128 KiB a token at the default layout:
# 4096 tokens is 512 MiB an engine, faulted in when registered).
KV_POOL_TOKENS=${KV_POOL_TOKENS:-4096}
KV_TRANSPORT=${KV_TRANSPORT:-shm}
while [ $# -gt 0 ]; do
	case $1 in
	--transport) KV_TRANSPORT=${2:?--transport needs shm, tcp or ucx}; shift 2 ;;
	--transport=*) KV_TRANSPORT=${1#*=}; shift ;;
	*) echo "run-local: unknown argument $1 (usage: $0 [--transport shm|tcp|ucx])" >&2; exit 2 ;;
	esac
done
case $KV_TRANSPORT in
shm | tcp | ucx) ;;
*) echo "run-local: transport $KV_TRANSPORT: want shm, tcp or ucx" >&2; exit 2 ;;
esac
export UCX_TLS=${UCX_TLS:-posix,cma,tcp} UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo}
RUN_DIR=$(mktemp -d)

names=() pids=()
cleanup() {
	trap - EXIT INT TERM
	for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
	wait 2>/dev/null || true
	rm -rf "$RUN_DIR"
}
trap cleanup EXIT INT TERM
trap 'exit 130' INT TERM

# fail names what went wrong, shows the end of a process's log, and exits.
fail() {
	echo "run-local: $1" >&2
	if [ -n "${2:-}" ] && [ -s "$RUN_DIR/$2.log" ]; then
		echo "--- last lines of $2's output:" >&2
		tail -n 20 "$RUN_DIR/$2.log" >&2
	fi
	exit 1
}

# A taken port would make one process exit at once; say which up front.
for p in "router:$ROUTER_PORT" "router metrics:$ROUTER_METRICS_PORT" "prefill engine:$PREFILL_PORT" \
	"decode engine:$DECODE_PORT" "bootstrap:$BOOTSTRAP_PORT" "prefill kvproxy metrics:$KVP_METRICS_PORT" \
	"decode kvproxy metrics:$KVD_METRICS_PORT"; do
	if (exec 3<>"/dev/tcp/127.0.0.1/${p##*:}") 2>/dev/null; then
		fail "port ${p##*:} (${p%:*}) is taken by another process; free it or set its *_PORT variable"
	fi
done

# start NAME CMD...: runs CMD in the background, its output in NAME's log.
start() {
	local name=$1
	shift
	"$@" >"$RUN_DIR/$name.log" 2>&1 &
	names+=("$name") pids+=($!)
}

# check fails if a started process is gone.
check() {
	local i status
	for i in "${!pids[@]}"; do
		if ! kill -0 "${pids[$i]}" 2>/dev/null; then
			status=0
			wait "${pids[$i]}" || status=$?
			fail "${names[$i]} exited (status $status) before the deployment was ready" "${names[$i]}"
		fi
	done
}

# wait_for WHAT CMD...: polls CMD until it succeeds, failing if a process
# exits or READY_TIMEOUT passes.
wait_for() {
	local what=$1 deadline=$((SECONDS + READY_TIMEOUT))
	shift
	until "$@"; do
		check
		[ $SECONDS -lt $deadline ] || fail "no $what within ${READY_TIMEOUT}s (logs in $RUN_DIR)"
		sleep 0.1
	done
}

# The prefill kvproxy serves the bootstrap API on the port the router
# hands out as bootstrap_port.
start "prefill kvproxy" "$BIN/kvproxy" --role prefill --transport "$KV_TRANSPORT" --control "$RUN_DIR/kv-p.sock" \
	--bootstrap-port "$BOOTSTRAP_PORT" --metrics-port "$KVP_METRICS_PORT"
start "decode kvproxy" "$BIN/kvproxy" --role decode --transport "$KV_TRANSPORT" --control "$RUN_DIR/kv-d.sock" \
	--metrics-port "$KVD_METRICS_PORT"
wait_for "kvproxy control sockets" test -S "$RUN_DIR/kv-p.sock" -a -S "$RUN_DIR/kv-d.sock"
start "prefill engine" "$BIN/mockworker" --role prefill --port "$PREFILL_PORT" --token-delay 20ms \
	--kvproxy "$RUN_DIR/kv-p.sock" --kv-pool-tokens "$KV_POOL_TOKENS"
start "decode engine" "$BIN/mockworker" --role decode --port "$DECODE_PORT" --token-delay 20ms \
	--kvproxy "$RUN_DIR/kv-d.sock" --kv-pool-tokens "$KV_POOL_TOKENS"
# The router starts once both engines answer (their pools registered), so
# its first look at them finds them healthy.
ok() { [ "$(curl -s -o /dev/null -w '%{http_code}' "localhost:$1/health" 2>/dev/null)" = 200 ]; }
wait_for "200 from the engines' /health" eval 'ok "$PREFILL_PORT" && ok "$DECODE_PORT"'
start router "$BIN/pdrouter" --pd-disaggregation \
	--prefill "http://127.0.0.1:$PREFILL_PORT" "$BOOTSTRAP_PORT" \
	--decode "http://127.0.0.1:$DECODE_PORT" \
	--host 0.0.0.0 --port "$ROUTER_PORT" --prometheus-port "$ROUTER_METRICS_PORT" --policy round_robin
ready() { [ "$(curl -s -o /dev/null -w '%{http_code}' "localhost:$ROUTER_PORT/readiness" 2>/dev/null)" = 200 ]; }
wait_for "200 from the router's /readiness" ready

cat <<MSG
pdrouter ready on :$ROUTER_PORT (prefill :$PREFILL_PORT, decode :$DECODE_PORT, KV over $KV_TRANSPORT;
kvproxy metrics on :$KVP_METRICS_PORT and :$KVD_METRICS_PORT; logs in $RUN_DIR). Try:
  curl -N localhost:$ROUTER_PORT/v1/chat/completions -d '{"model":"mock","messages":[{"role":"user","content":"hi"}],"stream":true}'
Ctrl-C stops everything.
MSG
# Until one of them exits: say which and why.
while :; do
	status=0
	wait -n -p gone "${pids[@]}" || status=$?
	for i in "${!pids[@]}"; do
		if [ "${pids[$i]}" = "${gone:-}" ]; then
			fail "${names[$i]} exited (status $status)" "${names[$i]}"
		fi
	done
done
