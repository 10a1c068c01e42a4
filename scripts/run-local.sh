#!/usr/bin/env bash
# make run: a local PD deployment on one machine. The router listens on
# :8000 (metrics on :29000) in front of one prefill and one decode mock
# engine, whose KV moves between their kvproxies over UCX on loopback
# (KV_TRANSPORT=tcp for the pure-Go transport). Ctrl-C stops everything.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-bin}
PREFILL_PORT=${PREFILL_PORT:-30001}
DECODE_PORT=${DECODE_PORT:-30002}
BOOTSTRAP_PORT=${BOOTSTRAP_PORT:-8998}
ROUTER_PORT=${ROUTER_PORT:-8000}
KV_TRANSPORT=${KV_TRANSPORT:-ucx}
export UCX_TLS=${UCX_TLS:-posix,cma,tcp} UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo}
RUN_DIR=$(mktemp -d)

pids=()
cleanup() {
	trap - EXIT INT TERM
	for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
	wait 2>/dev/null || true
	rm -rf "$RUN_DIR"
}
trap cleanup EXIT INT TERM

# The prefill kvproxy serves the bootstrap API on the port the router
# hands out as bootstrap_port.
"$BIN/kvproxy" --role prefill --transport "$KV_TRANSPORT" --control "$RUN_DIR/kv-p.sock" \
	--bootstrap-port "$BOOTSTRAP_PORT" --metrics-port 29101 &
pids+=($!)
"$BIN/kvproxy" --role decode --transport "$KV_TRANSPORT" --control "$RUN_DIR/kv-d.sock" --metrics-port 29102 &
pids+=($!)
for _ in $(seq 100); do
	[ -S "$RUN_DIR/kv-p.sock" ] && [ -S "$RUN_DIR/kv-d.sock" ] && break
	sleep 0.1
done
"$BIN/mockworker" --role prefill --port "$PREFILL_PORT" --token-delay 20ms --kvproxy "$RUN_DIR/kv-p.sock" &
pids+=($!)
"$BIN/mockworker" --role decode --port "$DECODE_PORT" --token-delay 20ms --kvproxy "$RUN_DIR/kv-d.sock" &
pids+=($!)
"$BIN/pdrouter" --pd-disaggregation \
	--prefill "http://127.0.0.1:$PREFILL_PORT" "$BOOTSTRAP_PORT" \
	--decode "http://127.0.0.1:$DECODE_PORT" \
	--host 0.0.0.0 --port "$ROUTER_PORT" --policy round_robin &
pids+=($!)

for _ in $(seq 100); do
	curl -fs "localhost:$ROUTER_PORT/readiness" >/dev/null 2>&1 && break
	sleep 0.1
done
cat <<MSG
pdrouter ready on :$ROUTER_PORT (prefill :$PREFILL_PORT, decode :$DECODE_PORT, KV over $KV_TRANSPORT;
kvproxy metrics on :29101 and :29102). Try:
  curl -N localhost:$ROUTER_PORT/v1/chat/completions -d '{"model":"mock","messages":[{"role":"user","content":"hi"}],"stream":true}'
Ctrl-C stops everything.
MSG
wait -n "${pids[@]}"
