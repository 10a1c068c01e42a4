#!/usr/bin/env bash
# make bench-ucx: ucx put bandwidth/latency against ucx_perftest, two
# processes per transport. Writes bench/out/ucx.json and the ucx section of
# bench/RESULTS.md.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v ucx_perftest >/dev/null || { echo "ucx_perftest missing: install ucx-utils" >&2; exit 1; }
bin=$(mktemp -d)
trap 'rm -rf "$bin"' EXIT
go build -o "$bin/ucxbench" ./cmd/ucxbench
"$bin/ucxbench" -role suite -runs "${RUNS:-5}" -json bench/out/ucx.json -md bench/RESULTS.md
cat bench/out/ucx.json
