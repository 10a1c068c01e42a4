package router

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"testing"
	"time"
)

// Row 12 / Deliver 8: a large body is held once, in the buffer fasthttp
// read it into; the legs are written from there (splice.Body). Before, the
// bootstrap splice (PD) or the rid (regular mode) copied it, so the router
// allocated twice the body.
func TestLargeBodyCostsItsSizeOnce(t *testing.T) {
	for _, pd := range []bool{true, false} {
		t.Run(map[bool]string{true: "pd", false: "regular"}[pd], func(t *testing.T) { largeBodyCost(t, pd) })
	}
}

func largeBodyCost(t *testing.T, pd bool) {
	const size = 64 << 20 // a power of two: fasthttp's buffer is exactly this
	discard := func(reply string) *httptest.Server {
		return httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if n, _ := io.Copy(io.Discard, r.Body); r.Method == "POST" && n < size {
				w.WriteHeader(400)
			}
			io.WriteString(w, reply)
		}))
	}
	p, d := discard(`{}`), discard(`{"text":"ok"}`)
	defer p.Close()
	defer d.Close()
	cfg := DefaultConfig()
	if pd {
		cfg.PDDisaggregation = true
		cfg.Prefill = []PrefillSpec{{URL: p.URL, BootstrapPort: 8998}}
		cfg.Decode = []string{d.URL}
	} else {
		cfg.WorkerURLs = []string{d.URL}
	}
	base, srv := serveInProcess(t, cfg)
	defer shutdown(t, srv)

	body := []byte(`{"text":"` + strings.Repeat("x", size-len(`{"text":""}`)) + `"}`)
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	resp, err := http.Post(base+"/generate", "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	reply, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	runtime.ReadMemStats(&after)
	if resp.StatusCode != 200 || string(reply) != `{"text":"ok"}` {
		t.Fatalf("status %d: %s", resp.StatusCode, reply)
	}
	allocated := after.TotalAlloc - before.TotalAlloc
	t.Logf("one %d MiB request: %.2f MiB allocated in the process (%.2fx the body)", size>>20, float64(allocated)/(1<<20), float64(allocated)/size)
	if allocated > size*5/4 {
		t.Fatalf("%d bytes allocated for a %d-byte body: the body is copied", allocated, size)
	}
	http.DefaultClient.CloseIdleConnections()
}

// Issue 26 item 9: a Content-Length over the limit is refused before the
// client sends the body: no 100 Continue first.
func TestExpectContinueRefusedByContentLength(t *testing.T) {
	d := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, `{}`) }))
	defer d.Close()
	cfg := DefaultConfig()
	cfg.WorkerURLs = []string{d.URL}
	cfg.MaxPayloadSize = 1 << 20
	base, srv := serveInProcess(t, cfg)
	defer shutdown(t, srv)
	conn, err := net.Dial("tcp", strings.TrimPrefix(base, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	fmt.Fprintf(conn, "POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nExpect: 100-continue\r\nContent-Length: %d\r\n\r\n", 2<<20)
	conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatal(err)
	}
	reply, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 413 || !strings.Contains(string(reply), `"code":"payload_too_large"`) {
		t.Fatalf("status %d: %s", resp.StatusCode, reply)
	}
}
