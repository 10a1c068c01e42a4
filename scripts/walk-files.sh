#!/bin/bash
# walk-files.sh [TREE] [STREAM]: the module's files one PD request runs code
# in (issue 23's "files visited"): a probe test, copied into TREE/router for
# the run only, sends one and then two requests to canned engines under
# -cover, and the files whose block counters grew with the second are
# listed. STREAM=1 streams. TREE defaults to this checkout. The engines are
# the hot-path benchmarks' (cannedBackend, router/hotpath_bench_test.go).
set -euo pipefail
tree=$(cd "${1:-$(dirname "$0")/..}" && pwd); stream=${2:-0}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"; rm -f "$tree/router/zz_walk_probe_test.go"' EXIT
cat > "$tree/router/zz_walk_probe_test.go" <<'GO'
package router

import (
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/valyala/fasthttp"
)

// TestWalkProbe sends WALK_N PD requests (scripts/walk-files.sh).
func TestWalkProbe(t *testing.T) {
	if os.Getenv("WALK_N") == "" {
		t.Skip("run by scripts/walk-files.sh")
	}
	cfg := DefaultConfig()
	cfg.PDDisaggregation = true
	stream := os.Getenv("WALK_STREAM") == "1"
	cfg.Prefill = []PrefillSpec{{URL: cannedBackend(t, stream), BootstrapPort: 8998}}
	cfg.Decode = []string{cannedBackend(t, stream)}
	base, srv := serveInProcess(t, cfg)
	defer srv.Shutdown(t.Context())
	c := &fasthttp.Client{}
	do := func() {
		req, resp := fasthttp.AcquireRequest(), fasthttp.AcquireResponse()
		req.SetRequestURI(base + "/generate")
		req.Header.SetMethod("POST")
		req.SetBodyString(`{"text":"The quick brown fox","stream":` + map[bool]string{true: "true", false: "false"}[stream] + `}`)
		if err := c.Do(req, resp); err != nil || resp.StatusCode() != 200 {
			t.Fatalf("%v %d", err, resp.StatusCode())
		}
	}
	n, _ := strconv.Atoi(os.Getenv("WALK_N"))
	for range n {
		do()
		time.Sleep(300 * time.Millisecond) // prefill's goroutine ends
	}
}
GO
cd "$tree"
go test -c -o "$tmp/walk.test" -cover -covermode=atomic -coverpkg=./router/...,./balancer/...,./internal/... ./router >/dev/null
cd router
for n in 1 2; do
	mkdir -p "$tmp/$n"
	WALK_N=$n WALK_STREAM=$stream "$tmp/walk.test" -test.run TestWalkProbe -test.gocoverdir="$tmp/$n" >/dev/null
	go tool covdata textfmt -i="$tmp/$n" -o "$tmp/$n.txt"
done
python3 - "$tmp/1.txt" "$tmp/2.txt" <<'PY'
import collections, sys
def counts(path):
    c = collections.Counter()
    for line in open(path).read().splitlines()[1:]:
        block, n = line.rsplit(' ', 1)
        c[block.rsplit(' ', 1)[0]] += int(n)
    return c
one, two = counts(sys.argv[1]), counts(sys.argv[2])
for f in sorted({b.split(':')[0] for b in two if two[b] > one[b]}):
    print(f.replace('github.com/pdrouter/pdrouter/', ''))
PY
