#!/usr/bin/env bash
# make bench-kv-sglang: SGLang 0.5.23's mooncake backend with Llama-3.1-8B KV
# through Mooncake's TransferEngine (TCP) and through kvproxy (tcp, UCX over
# tcp, UCX over shared memory), SGLang's nixl backend through NIXL 1.5 (PyPI,
# default UCX_TLS and tcp) and through python/nixl over kvproxy (UCX over tcp,
# shm), a memcpy over the same working set and the per-call cost, in one run
# -> bench/out/kv-sglang.json and a Markdown table. Arguments pass to
# python/harness/bench.py (e.g. --configs nixl-ucx,kvproxy-nixl-shm).
set -euo pipefail
cd "$(dirname "$0")/.."
eval "$(scripts/install-deps.sh sglang)"
bin=$(mktemp -d)
trap 'rm -rf "$bin"' EXIT
${GO:-go} build -o "$bin/kvproxy" ./cmd/kvproxy
export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo}
"$VENV/bin/python" python/harness/bench.py --python "$VENV/bin/python" --kvproxy "$bin/kvproxy" --nixl-path "$NIXL" \
	--mooncake-path "$MOONCAKE" --out bench/out/kv-sglang.json "$@"
