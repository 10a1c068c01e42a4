package router

import (
	"bufio"
	"bytes"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/pdrouter/pdrouter/testkit/testcerts"
)

// bodyModes are the modes that read client bodies: regular, SGLang PD and
// vLLM PD.
var bodyModes = []string{"regular", "pd", "vllm-pd"}

// bodyConfig is a router config of mode whose workers all answer worker.
func bodyConfig(t *testing.T, mode string, worker http.HandlerFunc) Config {
	t.Helper()
	url := func() string {
		s := httptest.NewServer(worker)
		t.Cleanup(s.Close)
		return s.URL
	}
	cfg := DefaultConfig()
	switch mode {
	case "regular":
		cfg.WorkerURLs = []string{url()}
	case "pd", "vllm-pd":
		cfg.PDDisaggregation = true
		cfg.VLLMPDDisaggregation = mode == "vllm-pd"
		cfg.Prefill = []PrefillSpec{{URL: url(), BootstrapPort: 8998}}
		cfg.Decode = []string{url()}
	}
	return cfg
}

// countingListener counts the bytes the router reads from each connection
// before it writes its first byte back.
type countingListener struct {
	net.Listener
	readBeforeReply chan int64
}

func (l *countingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return &countingConn{Conn: c, l: l}, nil
}

type countingConn struct {
	net.Conn
	l       *countingListener
	read    atomic.Int64
	replied sync.Once
}

func (c *countingConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	c.read.Add(int64(n))
	return n, err
}

func (c *countingConn) Write(p []byte) (int, error) {
	c.replied.Do(func() { c.l.readBeforeReply <- c.read.Load() })
	return c.Conn.Write(p)
}

// Issue 26 item 2: a chunked body over the limit is refused with a JSON
// 413 as soon as it crosses the limit, while the client is still sending:
// the router reads at most the limit and what one read brings beyond it.
func TestChunkedBodyRefusedAtTheLimit(t *testing.T) {
	for _, mode := range bodyModes {
		t.Run(mode, func(t *testing.T) {
			const limit = 3 << 20
			cfg := bodyConfig(t, mode, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, `{}`) })
			cfg.MaxPayloadSize = limit
			var cl *countingListener
			base, srv := serveInProcessThrough(t, cfg, prometheus.NewRegistry(), func(ln net.Listener) net.Listener {
				cl = &countingListener{Listener: ln, readBeforeReply: make(chan int64, 1)}
				return cl
			})
			defer shutdown(t, srv)

			conn, br := dialRouter(t, base)
			var before, after runtime.MemStats
			runtime.GC()
			runtime.GC()
			runtime.ReadMemStats(&before)
			io.WriteString(conn, "POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
			const chunkSize = 16 << 10
			chunk := fmt.Appendf(nil, "%x\r\n%s\r\n", chunkSize, bytes.Repeat([]byte("x"), chunkSize))
			go func() { // an endless body; it stops when the router closes
				for {
					if _, err := conn.Write(chunk); err != nil {
						return
					}
				}
			}()
			resp, err := http.ReadResponse(br, nil)
			if err != nil {
				t.Fatal(err)
			}
			reply, _ := io.ReadAll(resp.Body)
			if resp.StatusCode != 413 || !strings.Contains(string(reply), `"code":"payload_too_large"`) || !resp.Close {
				t.Fatalf("status %d close %v: %s", resp.StatusCode, resp.Close, reply)
			}
			runtime.ReadMemStats(&after)
			read := <-cl.readBeforeReply
			allocated := after.TotalAlloc - before.TotalAlloc
			t.Logf("%d bytes read and %d allocated before the 413 (limit %d)", read, allocated, limit)
			if read > limit+128<<10 {
				t.Fatalf("the router read %d bytes of a body over the %d-byte limit before refusing it", read, limit)
			}
			// fasthttp grew the body by copies into powers of two: 8 MiB
			// allocated to refuse a body at 3 MiB.
			if allocated > limit/2 {
				t.Fatalf("%d bytes allocated to refuse a body at the %d-byte limit", allocated, limit)
			}
		})
	}
}

// dialRouter opens a connection to the router at base for a test to write
// requests on by hand; reads from it time out after 20 s.
func dialRouter(t *testing.T, base string) (net.Conn, *bufio.Reader) {
	t.Helper()
	conn, err := net.Dial("tcp", strings.TrimPrefix(base, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	conn.SetReadDeadline(time.Now().Add(20 * time.Second))
	return conn, bufio.NewReader(conn)
}

// bodyPath is a generation route mode serves.
func bodyPath(mode string) string {
	if mode == "vllm-pd" {
		return "/v1/completions"
	}
	return "/generate"
}

// Issue 26 item 2: a body is read into one buffer of its own size, chunked
// or not, in every mode. fasthttp rounded a Content-Length body up to a
// power of two (2x for 64 MiB + 1) and grew a chunked one by copies (4x
// here, quadratic past 100 MB: a 500 MB chunked body peaked at 3.2 GB,
// read at 10 MB/s). Every mode reads them from the connection
// (headconn.go) and none copies it afterwards: the bootstrap splice (PD)
// and the rid (regular mode) write the legs from that buffer.
func TestBodyReadCostsItsSize(t *testing.T) {
	for _, mode := range bodyModes {
		for _, chunked := range []bool{false, true} {
			t.Run(mode+"/"+map[bool]string{true: "chunked", false: "content-length"}[chunked], func(t *testing.T) {
				const size = 64<<20 + 1
				cfg := bodyConfig(t, mode, func(w http.ResponseWriter, r *http.Request) {
					if n, _ := io.Copy(io.Discard, r.Body); r.Method == "POST" && n < size {
						w.WriteHeader(400)
					}
					io.WriteString(w, `{"text":"ok"}`)
				})
				base, srv := serveInProcess(t, cfg)
				defer shutdown(t, srv)

				body := []byte(`{"text":"` + strings.Repeat("x", size-len(`{"text":""}`)) + `"}`)
				var r io.Reader = bytes.NewReader(body)
				if chunked {
					r = struct{ io.Reader }{r} // no length known: the client sends it chunked
				}
				var before, after runtime.MemStats
				runtime.GC()
				runtime.GC() // and pooled buffers of an earlier run with it
				runtime.ReadMemStats(&before)
				resp, err := http.Post(base+bodyPath(mode), "application/json", r)
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
				t.Logf("%.2f MiB allocated for a %.2f MiB body (%.2fx)", float64(allocated)/(1<<20), float64(size)/(1<<20), float64(allocated)/size)
				if allocated > size*5/4 {
					t.Fatalf("%d bytes allocated for a %d-byte body", allocated, size)
				}
				http.DefaultClient.CloseIdleConnections()
			})
		}
	}
}

// "A large body on a keep-alive connection is held until GC": ten 48 MiB
// requests in a row on one connection grew the heap by 193 MiB, kept while
// the connection idled; in PD mode fasthttp's body pool kept the largest.
// The router gives a large body's memory back once its response is
// written.
func TestLargeBodyMemoryGivenBack(t *testing.T) {
	for _, mode := range bodyModes {
		t.Run(mode, func(t *testing.T) {
			cfg := bodyConfig(t, mode, func(w http.ResponseWriter, r *http.Request) {
				io.Copy(io.Discard, r.Body)
				io.WriteString(w, `{"text":"ok"}`)
			})
			base, srv := serveInProcess(t, cfg)
			defer shutdown(t, srv)
			const size = 48 << 20
			body := []byte(`{"text":"` + strings.Repeat("x", size-len(`{"text":""}`)) + `"}`)
			var before runtime.MemStats
			runtime.GC()
			runtime.GC()
			runtime.ReadMemStats(&before)
			client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 1}}
			defer client.CloseIdleConnections()
			for range 10 {
				resp, err := client.Post(base+bodyPath(mode), "application/json", bytes.NewReader(body))
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
		})
	}
}

// A large or chunked body is read from the connection after fasthttp read
// the head: what came after the body on the same connection (a pipelined
// request, sent in the same write) is still the next request, whatever the
// body's framing.
func TestBodyThenPipelinedRequest(t *testing.T) {
	text := strings.Repeat("y", 100<<10)
	large := `{"text":"` + text + `"}`
	for name, first := range map[string]string{
		"content-length": fmt.Sprintf("POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s", len(large), large),
		"chunked": "POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" +
			fmt.Sprintf("%x\r\n%s\r\n", 5, large[:5]) + fmt.Sprintf("%x;ext=1\r\n%s\r\n", len(large)-5, large[5:]) + "0\r\nX-Trailer: t\r\n\r\n",
		"small-chunked": "POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" +
			fmt.Sprintf("%x\r\n%s\r\n", len(`{"text":"`+text[:10]+`"}`), `{"text":"`+text[:10]+`"}`) + "0\r\n\r\n",
	} {
		for _, mode := range []string{"regular", "pd"} {
			t.Run(mode+"/"+name, func(t *testing.T) {
				var texts sync.Map // the texts the workers received
				cfg := bodyConfig(t, mode, func(w http.ResponseWriter, r *http.Request) {
					var req struct{ Text string }
					if json.NewDecoder(r.Body).Decode(&req) == nil && r.Method == "POST" {
						texts.Store(req.Text, true)
					}
					io.WriteString(w, `{"text":"ok"}`)
				})
				base, srv := serveInProcess(t, cfg)
				defer shutdown(t, srv)
				conn, br := dialRouter(t, base)
				second := `{"text":"second"}`
				io.WriteString(conn, first+fmt.Sprintf("POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s", len(second), second))
				for i := range 2 {
					resp, err := http.ReadResponse(br, nil)
					if err != nil {
						t.Fatalf("response %d: %v", i, err)
					}
					reply, _ := io.ReadAll(resp.Body)
					if resp.StatusCode != 200 || resp.Close {
						t.Fatalf("response %d: status %d close %v: %s", i, resp.StatusCode, resp.Close, reply)
					}
				}
				// Both reached the workers whole.
				n := 0
				texts.Range(func(k, _ any) bool {
					if k != "second" && !strings.HasPrefix(text, k.(string)) {
						t.Errorf("a worker received text %.20q...", k)
					}
					n++
					return true
				})
				if n != 2 {
					t.Fatalf("%d distinct texts reached the workers, want the two sent", n)
				}
			})
		}
	}
}

// A body that breaks off is refused: a JSON 400 for one cut short or
// badly framed, a 408 for one that stalls past --body-read-timeout, and
// the connection is closed after.
func TestBrokenBodyRefused(t *testing.T) {
	large := strings.Repeat("z", 20<<10)
	for _, mode := range bodyModes {
		for name, c := range map[string]struct {
			request string
			status  int
		}{
			"content-length cut":  {fmt.Sprintf("POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s", 2*len(large), large), 400},
			"chunked cut":         {"POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + fmt.Sprintf("%x\r\n%s", 2*len(large), large), 400},
			"chunk size not hex":  {"POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n", 400},
			"chunk without crlf":  {"POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabcdef\r\n0\r\n\r\n", 400},
			"trailer cut":         {"POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\nX-A: b\r\n", 400},
			"content-length slow": {fmt.Sprintf("POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s", 2*len(large), large), 408},
		} {
			t.Run(mode+"/"+name, func(t *testing.T) {
				cfg := bodyConfig(t, mode, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, `{}`) })
				cfg.BodyReadTimeout = 300 * time.Millisecond
				base, srv := serveInProcess(t, cfg)
				defer shutdown(t, srv)
				conn, br := dialRouter(t, base)
				io.WriteString(conn, strings.Replace(c.request, "/generate", bodyPath(mode), 1))
				if c.status == 400 {
					conn.(*net.TCPConn).CloseWrite() // the body ends here
				}
				resp, err := http.ReadResponse(br, nil)
				if err != nil {
					t.Fatal(err)
				}
				reply, _ := io.ReadAll(resp.Body)
				if resp.StatusCode != c.status || !strings.Contains(string(reply), `"error"`) || !resp.Close {
					t.Fatalf("status %d close %v: %s; want %d, closed", resp.StatusCode, resp.Close, reply, c.status)
				}
			})
		}
	}
}

// A response sent without reading the body left on the connection (a
// method refused, a CORS preflight) closes it: the body's bytes are not
// taken for a next request, so a request hidden in a body is never served.
func TestUnreadBodyClosesTheConnection(t *testing.T) {
	hidden := "GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
	body := strings.Repeat(" ", 10<<10) + hidden // over smallBody: left on the connection
	for name, head := range map[string]string{
		"refused method": "PURGE /generate HTTP/1.1\r\nHost: x\r\n",
		"cors preflight": "OPTIONS /generate HTTP/1.1\r\nHost: x\r\nOrigin: http://a\r\nAccess-Control-Request-Method: POST\r\n",
	} {
		for _, mode := range []string{"regular", "pd"} {
			for _, chunked := range []bool{false, true} {
				t.Run(fmt.Sprintf("%s/%s/chunked=%v", mode, name, chunked), func(t *testing.T) {
					cfg := bodyConfig(t, mode, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, `{}`) })
					base, srv := serveInProcess(t, cfg)
					defer shutdown(t, srv)
					conn, br := dialRouter(t, base)
					if chunked {
						fmt.Fprintf(conn, "%sTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n", head, len(body), body)
					} else {
						fmt.Fprintf(conn, "%sContent-Length: %d\r\n\r\n%s", head, len(body), body)
					}
					resp, err := http.ReadResponse(br, nil)
					if err != nil {
						t.Fatal(err)
					}
					io.Copy(io.Discard, resp.Body)
					if !resp.Close {
						t.Fatalf("status %d, connection kept after a body left unread", resp.StatusCode)
					}
					if rest, _ := io.ReadAll(br); len(rest) > 0 {
						t.Fatalf("a second response after the first: %q", rest)
					}
				})
			}
		}
	}
}

// A large body sent after 100 Continue is read from the connection too.
func TestExpectContinueLargeBody(t *testing.T) {
	for _, mode := range []string{"regular", "pd"} {
		t.Run(mode, func(t *testing.T) { expectContinueLargeBody(t, mode) })
	}
}

func expectContinueLargeBody(t *testing.T, mode string) {
	var got atomic.Int64
	cfg := bodyConfig(t, mode, func(w http.ResponseWriter, r *http.Request) {
		n, _ := io.Copy(io.Discard, r.Body)
		got.Store(n)
		io.WriteString(w, `{"text":"ok"}`)
	})
	base, srv := serveInProcess(t, cfg)
	defer shutdown(t, srv)
	conn, br := dialRouter(t, base)
	body := `{"text":"` + strings.Repeat("e", 50<<10) + `"}`
	fmt.Fprintf(conn, "POST /generate HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: %d\r\n\r\n", len(body))
	line, err := br.ReadString('\n')
	if err != nil || !strings.HasPrefix(line, "HTTP/1.1 100") {
		t.Fatalf("%q %v; want 100 Continue", line, err)
	}
	br.ReadString('\n') // the blank line after it
	io.WriteString(conn, body)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	reply, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 || got.Load() < int64(len(body)) {
		t.Fatalf("status %d: %s; the worker got %d bytes of a %d-byte body", resp.StatusCode, reply, got.Load(), len(body))
	}
}

// chunkedConn returns data in reads of the given sizes.
type chunkedConn struct {
	net.Conn
	data  []byte
	sizes []byte
}

func (c *chunkedConn) Read(p []byte) (int, error) {
	if len(c.data) == 0 {
		return 0, io.EOF
	}
	n := len(c.data)
	if len(c.sizes) > 0 {
		n = min(n, int(c.sizes[0])+1)
		c.sizes = c.sizes[1:]
	}
	n = copy(p, c.data[:n])
	c.data = c.data[n:]
	return n, nil
}

// headConn ends a read at every empty line, however the bytes arrive, and
// returns every byte once, in order.
func FuzzHeadConnEndsReadsAtEmptyLines(f *testing.F) {
	f.Add([]byte("POST / HTTP/1.1\r\nA: b\r\n\r\nbody\n\nGET / HTTP/1.1\r\n\r\n"), []byte{3, 200, 0, 1, 7}, uint8(16))
	f.Add([]byte("\n\r\n\n\r\r\n\n"), []byte{0, 0, 1}, uint8(2))
	f.Fuzz(func(t *testing.T, data, sizes []byte, bufSize uint8) {
		c := &headConn{Conn: &chunkedConn{data: data, sizes: sizes}}
		var got []byte
		ends := map[int]bool{}
		buf := make([]byte, int(bufSize)+1)
		for len(got) < len(data) {
			n, err := c.Read(buf)
			got = append(got, buf[:n]...)
			ends[len(got)] = true
			if err != nil {
				break
			}
		}
		if !bytes.Equal(got, data) {
			t.Fatalf("read %q, want %q", got, data)
		}
		for i := 1; i < len(data); i++ {
			emptyLine := data[i] == '\n' && (data[i-1] == '\n' || (i >= 2 && data[i-1] == '\r' && data[i-2] == '\n'))
			if emptyLine && !ends[i+1] {
				t.Fatalf("no read ends after the empty line ending at %d of %q", i, data)
			}
		}
	})
}

// Over an HTTPS front end the connection is a headConn over TLS: bodies
// are read the same way, and it keeps the methods fasthttp tells TLS by.
func TestBodyOverTLS(t *testing.T) {
	for _, mode := range []string{"regular", "pd"} {
		t.Run(mode, func(t *testing.T) { bodyOverTLS(t, mode) })
	}
}

func bodyOverTLS(t *testing.T, mode string) {
	ca := testcerts.NewCA(t, "front")
	pair := ca.Server(t, "front")
	text := strings.Repeat("t", 200<<10)
	var got sync.Map
	cfg := bodyConfig(t, mode, func(w http.ResponseWriter, r *http.Request) {
		var req struct{ Text string }
		if json.NewDecoder(r.Body).Decode(&req) == nil && r.Method == "POST" {
			got.Store(req.Text, true)
		}
		io.WriteString(w, `{"text":"ok"}`)
	})
	cfg.TLSCertPath, cfg.TLSKeyPath = pair.CertFile, pair.KeyFile
	base, srv := serveInProcess(t, cfg)
	defer shutdown(t, srv)
	c := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: ca.Pool()}}}
	defer c.CloseIdleConnections()
	url := "https://" + strings.TrimPrefix(base, "http://") + "/generate"
	for _, body := range []io.Reader{
		strings.NewReader(`{"text":"small"}`),
		strings.NewReader(`{"text":"` + text + `"}`),
		struct{ io.Reader }{strings.NewReader(`{"text":"` + text[1:] + `"}`)}, // chunked
	} {
		resp, err := c.Post(url, "application/json", body)
		if err != nil {
			t.Fatal(err)
		}
		reply, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || resp.TLS == nil {
			t.Fatalf("status %d: %s", resp.StatusCode, reply)
		}
	}
	for _, want := range []string{"small", text, text[1:]} {
		if _, ok := got.Load(want); !ok {
			t.Errorf("the workers never received the text of %d bytes", len(want))
		}
	}
	var _ interface{ ConnectionState() tls.ConnectionState } = (*headTLSConn)(nil)
}
