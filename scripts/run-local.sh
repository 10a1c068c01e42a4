#!/usr/bin/env bash
# make run: a local PD deployment on one machine. The router listens on
# :8000 (metrics on :29000) in front of one prefill and one decode mock
# engine. Ctrl-C stops everything.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-bin}
PREFILL_PORT=${PREFILL_PORT:-30001}
DECODE_PORT=${DECODE_PORT:-30002}
BOOTSTRAP_PORT=${BOOTSTRAP_PORT:-8998}
ROUTER_PORT=${ROUTER_PORT:-8000}

pids=()
cleanup() {
	trap - EXIT INT TERM
	for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
	wait 2>/dev/null || true
}
trap cleanup EXIT INT TERM

"$BIN/mockworker" --role prefill --port "$PREFILL_PORT" --token-delay 20ms &
pids+=($!)
"$BIN/mockworker" --role decode --port "$DECODE_PORT" --token-delay 20ms &
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
pdrouter ready on :$ROUTER_PORT (prefill :$PREFILL_PORT, decode :$DECODE_PORT). Try:
  curl -N localhost:$ROUTER_PORT/v1/chat/completions -d '{"model":"mock","messages":[{"role":"user","content":"hi"}],"stream":true}'
Ctrl-C stops everything.
MSG
wait -n "${pids[@]}"
