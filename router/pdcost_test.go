package router

import (
	"bufio"
	"net"
	runtimemetrics "runtime/metrics"
	"strconv"
	"strings"
	"testing"

	"github.com/valyala/fasthttp"
)

// pdPoster serves PD 1P+1D in process on canned engines that answer at
// once, and returns a function posting one non-streamed /generate to it
// over one keep-alive connection (by hand: a client of fasthttp or net/http
// would leave goroutines of its own behind).
func pdPoster(t *testing.T) func() {
	t.Helper()
	cfg := DefaultConfig()
	cfg.PDDisaggregation = true
	cfg.Prefill = []PrefillSpec{{URL: cannedBackend(t, false), BootstrapPort: 8998}}
	cfg.Decode = []string{cannedBackend(t, false)}
	return poster(t, cfg)
}

// regularPoster is pdPoster in regular mode, on one canned engine.
func regularPoster(t *testing.T) func() {
	t.Helper()
	cfg := DefaultConfig()
	cfg.WorkerURLs = []string{cannedBackend(t, false)}
	return poster(t, cfg)
}

// poster serves cfg in process and returns pdPoster's function for it.
func poster(t *testing.T, cfg Config) func() {
	t.Helper()
	base, srv := serveInProcess(t, cfg)
	t.Cleanup(func() { shutdown(t, srv) })
	conn, err := net.Dial("tcp", strings.TrimPrefix(base, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	body := `{"text":"The quick brown fox","sampling_params":{"max_new_tokens":4},"stream":false}`
	req := []byte("POST /generate HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\nContent-Length: " +
		strconv.Itoa(len(body)) + "\r\n\r\n" + body)
	br := bufio.NewReader(conn)
	var resp fasthttp.Response
	return func() {
		if _, err := conn.Write(req); err != nil {
			t.Fatal(err)
		}
		if err := resp.Read(br); err != nil || resp.StatusCode() != 200 {
			t.Fatalf("%v %d %s", err, resp.StatusCode(), resp.Body())
		}
	}
}

func goroutinesCreated() uint64 {
	s := []runtimemetrics.Sample{{Name: "/sched/goroutines-created:goroutines"}}
	runtimemetrics.Read(s)
	return s[0].Value.Uint64()
}

// A non-streamed PD request whose prefill answers at once runs both legs on
// the handler's goroutine: waking a goroutine for the prefill leg cost a
// futex and the scheduler's usleep before another core stole it (before:
// one goroutine per request).
func TestPDRequestStartsNoGoroutine(t *testing.T) {
	post := pdPoster(t)
	for range 20 { // pooled connections to both engines
		post()
	}
	const n = 300
	before := goroutinesCreated()
	for range n {
		post()
	}
	if got := goroutinesCreated() - before; got > n/10 {
		t.Fatalf("%d goroutines created for %d PD requests, want none per request", got, n)
	}
}
