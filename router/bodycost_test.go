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
	allocated := allocatedByPost(t, base+"/generate", bytes.NewReader(body))
	t.Logf("one %d MiB request: %.2f MiB allocated in the process (%.2fx the body)", size>>20, float64(allocated)/(1<<20), float64(allocated)/size)
	if allocated > size*5/4 {
		t.Fatalf("%d bytes allocated for a %d-byte body: the body is copied", allocated, size)
	}
	http.DefaultClient.CloseIdleConnections()
}

// allocatedByPost posts body to url, expecting {"text":"ok"}, and returns
// the bytes the whole process allocated meanwhile.
func allocatedByPost(t *testing.T, url string, body io.Reader) uint64 {
	t.Helper()
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	resp, err := http.Post(url, "application/json", body)
	if err != nil {
		t.Fatal(err)
	}
	reply, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	runtime.ReadMemStats(&after)
	if resp.StatusCode != 200 || string(reply) != `{"text":"ok"}` {
		t.Fatalf("status %d: %s", resp.StatusCode, reply)
	}
	return after.TotalAlloc - before.TotalAlloc
}

// Issue 26 item 2: a body is read into one buffer of its own size, chunked
// or not. fasthttp rounded a Content-Length body up to a power of two (2x
// for 64 MiB + 1) and grew a chunked one by copies (2x, and quadratic past
// 100 MB: a 500 MB chunked body peaked at 3.2 GB, read at 10 MB/s).
func TestBodyReadCostsItsSize(t *testing.T) {
	for _, chunked := range []bool{false, true} {
		t.Run(map[bool]string{true: "chunked", false: "content-length"}[chunked], func(t *testing.T) {
			const size = 64<<20 + 1
			d := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if n, _ := io.Copy(io.Discard, r.Body); r.Method == "POST" && n < size {
					w.WriteHeader(400)
				}
				io.WriteString(w, `{"text":"ok"}`)
			}))
			defer d.Close()
			cfg := DefaultConfig()
			cfg.WorkerURLs = []string{d.URL}
			base, srv := serveInProcess(t, cfg)
			defer shutdown(t, srv)

			body := []byte(`{"text":"` + strings.Repeat("x", size-len(`{"text":""}`)) + `"}`)
			var r io.Reader = bytes.NewReader(body)
			if chunked {
				r = struct{ io.Reader }{r} // no length known: the client sends it chunked
			}
			allocated := allocatedByPost(t, base+"/generate", r)
			t.Logf("%.2f MiB allocated for a %.2f MiB body (%.2fx)", float64(allocated)/(1<<20), float64(size)/(1<<20), float64(allocated)/size)
			if allocated > size*5/4 {
				t.Fatalf("%d bytes allocated for a %d-byte body", allocated, size)
			}
			http.DefaultClient.CloseIdleConnections()
		})
	}
}

// A chunked body is refused with a JSON 413 as soon as it crosses the
// limit, while the client is still sending: the router does not read on.
func TestChunkedBodyRefusedAtTheLimit(t *testing.T) {
	conn := dialLimitedRouter(t)
	io.WriteString(conn, "POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
	chunk := fmt.Appendf(nil, "%x\r\n%s\r\n", 64<<10, bytes.Repeat([]byte("x"), 64<<10))
	sent := 0
	go func() { // an endless body; it stops when the router closes
		for {
			if _, err := conn.Write(chunk); err != nil {
				return
			}
			sent += 64 << 10
		}
	}()
	resp, reply := readResponse(t, conn)
	if resp.StatusCode != 413 || !strings.Contains(string(reply), `"code":"payload_too_large"`) || !resp.Close {
		t.Fatalf("status %d close %v: %s", resp.StatusCode, resp.Close, reply)
	}
}

// dialLimitedRouter connects to a regular-mode router whose body limit is
// 1 MiB.
func dialLimitedRouter(t *testing.T) net.Conn {
	d := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, `{}`) }))
	t.Cleanup(d.Close)
	cfg := DefaultConfig()
	cfg.WorkerURLs = []string{d.URL}
	cfg.MaxPayloadSize = 1 << 20
	base, srv := serveInProcess(t, cfg)
	t.Cleanup(func() { shutdown(t, srv) })
	conn, err := net.Dial("tcp", strings.TrimPrefix(base, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// readResponse reads the router's answer on conn, within ten seconds.
func readResponse(t *testing.T, conn net.Conn) (*http.Response, []byte) {
	conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatal(err)
	}
	reply, _ := io.ReadAll(resp.Body)
	return resp, reply
}

// Issue 26 item 9: a Content-Length over the limit is refused before the
// client sends the body: no 100 Continue first.
func TestExpectContinueRefusedByContentLength(t *testing.T) {
	conn := dialLimitedRouter(t)
	fmt.Fprintf(conn, "POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nExpect: 100-continue\r\nContent-Length: %d\r\n\r\n", 2<<20)
	resp, reply := readResponse(t, conn)
	if resp.StatusCode != 413 || !strings.Contains(string(reply), `"code":"payload_too_large"`) {
		t.Fatalf("status %d: %s", resp.StatusCode, reply)
	}
}

// "A large body on a keep-alive connection is held until GC": ten 48 MiB
// requests in a row on one connection grew the heap by 193 MiB, kept while
// the connection idled. The router gives a large body's memory back once
// its response is written.
func TestLargeBodyMemoryGivenBack(t *testing.T) {
	d := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		io.WriteString(w, `{"text":"ok"}`)
	}))
	defer d.Close()
	cfg := DefaultConfig()
	cfg.WorkerURLs = []string{d.URL}
	base, srv := serveInProcess(t, cfg)
	defer shutdown(t, srv)
	const size = 48 << 20
	body := []byte(`{"text":"` + strings.Repeat("x", size-len(`{"text":""}`)) + `"}`)
	var before runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 1}}
	defer client.CloseIdleConnections()
	for range 10 {
		resp, err := client.Post(base+"/generate", "application/json", bytes.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("status %d", resp.StatusCode)
		}
	}
	body = nil
	// The connection stays open and idle; no collection is forced here.
	deadline := time.Now().Add(5 * time.Second)
	for {
		var now runtime.MemStats
		runtime.ReadMemStats(&now)
		held := int64(now.HeapInuse) - int64(before.HeapInuse)
		if held < size/2 {
			t.Logf("heap in use %+.1f MiB after ten %d MiB bodies", float64(held)/(1<<20), size>>20)
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("heap in use still %+.1f MiB after ten %d MiB bodies on an idle connection", float64(held)/(1<<20), size>>20)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
