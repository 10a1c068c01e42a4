#!/usr/bin/env bash
# The Python side of kvproxy's engine-owned memory: python/'s unit tests
# against a real kvproxy, then SGLang 0.5.23's own mooncake PD backend
# (python/harness) with pdrouter's TransferEngine over kvproxy, with
# kvproxy's bootstrap server instead of SGLang's, and with Mooncake's real
# TransferEngine, and SGLang's own nixl backend (0.5.23's, and 0.5.20's that
# completes by NIXL notifications) with pdrouter's nixl look-alike. Sizes are CI's; `make bench-kv-sglang` runs the big ones.
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
eval "$(scripts/install-deps.sh sglang)"
GO=${GO:-go}
bin=$(mktemp -d)
trap 'rm -rf "$bin"' EXIT
$GO build -o "$bin/kvproxy" ./cmd/kvproxy
export KVPROXY=$bin/kvproxy
work=${TMPDIR:-/tmp}/pdrouter-sglang-$$
passed=0 failed=0
run() {
	local name=$1
	shift
	echo "--- sglang-kv: $name" >&2
	if "$@"; then passed=$((passed + 1)); else failed=$((failed + 1)); echo "FAIL: $name (logs in $work)" >&2; fi
}
run "python unit tests (control client, TransferEngine, remap) against kvproxy" \
	bash -c 'cd python && python3 -m unittest discover -s tests -t .'
run "the harness's kvproxies and engines end with it (SIGTERM, SIGKILL)" \
	bash -c 'cd python/harness && python3 -m unittest test_children test_ports'
# python3 may lack numpy (batches then go as triples): page writes with it.
run "TransferEngine page writes and the nixl look-alike, with numpy" \
	bash -c "cd python && '$VENV/bin/python' -m unittest tests.test_pageplan tests.test_engine_pages tests.test_nixl"
# The harness runs in the background so that a SIGTERM or SIGINT to this
# script reaches it (bash runs traps only between commands), and it stops
# its kvproxies and engines (python/harness/children.py).
child=
trap '[ -n "$child" ] && kill -TERM "$child" 2>/dev/null; wait; exit 143' TERM INT HUP
harness() {
	local name=$1
	shift
	"$VENV/bin/python" python/harness/run_pd.py --python "$VENV/bin/python" --workdir "$work/$name" --label "$name" "$@" &
	child=$!
	local rc=0
	wait "$child" || rc=$?
	child=
	return "$rc"
}
run "kvproxy tcp, SGLang's bootstrap: 200 requests, abort, prefill and decode kvproxy killed and restarted, decode killed" \
	harness ours --engine kvproxy --kvproxy "$KVPROXY" --requests 200 --phases normal,kill-prefill-kvproxy,kill-decode-kvproxy,recover,kill-decode
run "kvproxy tcp, kvproxy's bootstrap server: 50 requests, abort" \
	harness ours-kvproxy-bootstrap --engine kvproxy --kvproxy "$KVPROXY" --bootstrap kvproxy --requests 50 --phases normal
run "SGLang's nixl backend on python/nixl, kvproxy tcp: 100 requests, abort, prefill and decode kvproxy killed and restarted, decode killed" \
	harness nixl --engine nixl --kvproxy "$KVPROXY" --requests 100 --phases normal,kill-prefill-kvproxy,kill-decode-kvproxy,recover,kill-decode
# SGLang 0.5.20 learns that a room landed from NIXL notifications, 0.5.23 from ZMQ: the look-alike serves both.
run "SGLang 0.5.20's nixl backend (completion by NIXL notifications) on python/nixl, kvproxy tcp: 50 requests, abort, prefill and decode kvproxy killed and restarted, decode killed" \
	harness nixl-0.5.20 --engine nixl --sglang-path "$SGLANG_OLD" --kvproxy "$KVPROXY" --requests 50 --phases normal,kill-prefill-kvproxy,kill-decode-kvproxy,recover,kill-decode
run "Mooncake's TransferEngine (tcp): 50 requests, abort, decode killed" \
	harness mooncake --engine mooncake --mooncake-path "$MOONCAKE" --requests 50 --phases normal,kill-decode
[ "$failed" -eq 0 ] && rm -rf "$work"
echo "sglang-kv: $(($(date +%s) - t0)) s" >&2
echo "sglang-kv: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
