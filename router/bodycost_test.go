package router

import (
	"bytes"
	"io"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"testing"
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
