//go:build linux

package main

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func startProxy(t *testing.T, backend string) string {
	t.Helper()
	p, err := start("127.0.0.1:0", backend, 2)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.close)
	return p.addr
}

// client is one kept-alive client connection that sends raw requests.
type client struct {
	t    *testing.T
	conn net.Conn
	r    *bufio.Reader
}

func dial(t *testing.T, addr string) *client {
	t.Helper()
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
	return &client{t, conn, bufio.NewReader(conn)}
}

// do writes each piece of a request (pausing between them) and reads the reply.
func (c *client) do(method string, pieces ...string) (*http.Response, string) {
	c.t.Helper()
	for i, p := range pieces {
		if i > 0 {
			time.Sleep(5 * time.Millisecond)
		}
		if _, err := io.WriteString(c.conn, p); err != nil {
			c.t.Fatal(err)
		}
	}
	resp, err := http.ReadResponse(c.r, &http.Request{Method: method})
	if err != nil {
		c.t.Fatal(err)
	}
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		c.t.Fatal(err)
	}
	return resp, string(body)
}

func post(path, body string, headers ...string) string {
	return fmt.Sprintf("POST %s HTTP/1.1\r\nHost: x\r\n%sContent-Length: %d\r\n\r\n%s", path, strings.Join(headers, ""), len(body), body)
}

// echo answers 201 with what it was sent and counts the connections it accepted.
func echo(t *testing.T) (addr string, conns *atomic.Int32) {
	conns = new(atomic.Int32)
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		w.Header().Set("X-Got", fmt.Sprintf("%s %s x-test=%q connection=%q", r.Method, r.URL.Path, r.Header.Get("X-Test"), r.Header.Get("Connection")))
		w.WriteHeader(201)
		fmt.Fprintf(w, "echo:%s", body)
	}))
	srv.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateNew {
			conns.Add(1)
		}
	}
	srv.Start()
	t.Cleanup(srv.Close)
	return srv.Listener.Addr().String(), conns
}

func TestForwardsRequestAndReply(t *testing.T) {
	backend, _ := echo(t)
	c := dial(t, startProxy(t, backend))
	resp, body := c.do("POST", post("/v1/completions", `{"prompt":"x"}`, "X-Test: a b\r\n", "Connection: keep-alive\r\n"))
	got := resp.Header.Get("X-Got")
	if resp.StatusCode != 201 || body != `echo:{"prompt":"x"}` || got != `POST /v1/completions x-test="a b" connection=""` {
		t.Fatalf("got %d %q, backend saw %s", resp.StatusCode, body, got)
	}
	if resp, body = c.do("GET", "GET /health HTTP/1.1\r\nHost: x\r\n\r\n"); resp.StatusCode != 201 || body != "echo:" || resp.Header.Get("X-Got") != `GET /health x-test="" connection=""` {
		t.Fatalf("GET: got %d %q %q", resp.StatusCode, body, resp.Header.Get("X-Got"))
	}
}

func TestKeepAliveReusesConnections(t *testing.T) {
	backend, conns := echo(t)
	c := dial(t, startProxy(t, backend))
	for i := range 5 {
		want := fmt.Sprint(i)
		if resp, body := c.do("POST", post("/generate", want)); resp.StatusCode != 201 || body != "echo:"+want {
			t.Fatalf("request %d: got %d %q", i, resp.StatusCode, body)
		}
	}
	if n := conns.Load(); n != 1 {
		t.Fatalf("the backend saw %d connections for 5 requests on one client connection, want 1 (pooled)", n)
	}
	// Connection: close ends the client's connection after its reply.
	if resp, _ := c.do("POST", post("/generate", "", "Connection: close\r\n")); resp.StatusCode != 201 {
		t.Fatalf("got %d", resp.StatusCode)
	}
	if n, err := c.r.Read(make([]byte, 1)); err != io.EOF {
		t.Fatalf("after Connection: close the proxy kept the connection open (read %d, %v)", n, err)
	}
	// So does an HTTP/1.0 request.
	c = dial(t, c.conn.RemoteAddr().String())
	if resp, body := c.do("GET", "GET /x HTTP/1.0\r\n\r\n"); resp.StatusCode != 201 || body != "echo:" {
		t.Fatalf("HTTP/1.0: got %d %q", resp.StatusCode, body)
	}
	if n, err := c.r.Read(make([]byte, 1)); err != io.EOF {
		t.Fatalf("after an HTTP/1.0 request the proxy kept the connection open (read %d, %v)", n, err)
	}
}

// rawBackend answers every request on its first connection by writing pieces,
// pausing between them; with no pieces it hangs up on the first request.
func rawBackend(t *testing.T, pieces ...string) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	t.Cleanup(func() { ln.Close(); <-done })
	go func() {
		defer close(done)
		conn, err := ln.Accept()
		if err != nil {
			return
		}
		defer conn.Close()
		r := bufio.NewReader(conn)
		for {
			req, err := http.ReadRequest(r)
			if err != nil {
				return
			}
			_, _ = io.Copy(io.Discard, req.Body)
			if len(pieces) == 0 {
				return
			}
			for _, p := range pieces {
				if _, err := io.WriteString(conn, p); err != nil {
					return
				}
				time.Sleep(5 * time.Millisecond)
			}
		}
	}()
	return ln.Addr().String()
}

func TestChunkedReplyRelayedWhole(t *testing.T) {
	// Each piece ends somewhere awkward: in a size line, between a chunk and its CRLF, in the trailers.
	backend := rawBackend(t, "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", "5\r", "\nhello", "\r\n1", "0;ext=1\r\n0123456789abcdef", "\r\n0\r\nX-Trailer: t\r", "\n", "\r\n")
	c := dial(t, startProxy(t, backend))
	for i := range 2 { // the second proves the proxy found the first reply's end
		resp, body := c.do("POST", post("/generate", "x"))
		if resp.StatusCode != 200 || body != "hello0123456789abcdef" || resp.Trailer.Get("X-Trailer") != "t" {
			t.Fatalf("reply %d: got %d %q trailer %q", i, resp.StatusCode, body, resp.Trailer)
		}
	}
}

func TestRequestBodySplitOverWrites(t *testing.T) {
	backend, _ := echo(t)
	c := dial(t, startProxy(t, backend))
	head := "POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 12\r\n\r\n"
	if resp, body := c.do("POST", head[:20], head[20:], "hello ", "wor", "ld!"); resp.StatusCode != 201 || body != "echo:hello world!" {
		t.Fatalf("got %d %q", resp.StatusCode, body)
	}
	// A body many times the proxy's buffer, in one write, on the same connection.
	big := strings.Repeat("0123456789", 50_000)
	if resp, body := c.do("POST", post("/generate", big)); resp.StatusCode != 201 || body != "echo:"+big {
		t.Fatalf("big body: got %d, %d bytes", resp.StatusCode, len(body))
	}
}

func TestRejectsWhatItCannotFrame(t *testing.T) {
	backend, conns := echo(t)
	proxy := startProxy(t, backend)
	for _, tc := range []struct{ req, want string }{
		{"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", "411"},
		{"GET / HTTP/2.0\r\n\r\n", "505"},
		{"POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nx", "400"},
		// Exactly a buffer of head, all read, so that closing sends no reset before the reply.
		{"GET / HTTP/1.1\r\nX: " + strings.Repeat("a", bufSize-len("GET / HTTP/1.1\r\nX: ")), "431"},
	} {
		resp, _ := dial(t, proxy).do("GET", tc.req)
		if fmt.Sprint(resp.StatusCode) != tc.want {
			t.Errorf("%.40q: got %d, want %s", tc.req, resp.StatusCode, tc.want)
		}
	}
	if n := conns.Load(); n != 0 {
		t.Fatalf("rejected requests reached the backend (%d connections)", n)
	}
}

func TestDeadBackendIs502(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := ln.Addr().String()
	ln.Close()
	proxy := startProxy(t, dead)
	for i := range 3 { // the proxy keeps serving after each failure
		if resp, _ := dial(t, proxy).do("POST", post("/generate", "x")); resp.StatusCode != 502 {
			t.Fatalf("request %d: got %d, want 502", i, resp.StatusCode)
		}
	}
	// A backend that hangs up without a reply also gives a 502.
	backend := rawBackend(t)
	if resp, _ := dial(t, startProxy(t, backend)).do("POST", post("/generate", "x")); resp.StatusCode != 502 {
		t.Fatalf("backend hung up: got %d, want 502", resp.StatusCode)
	}
}

func openFDs(t *testing.T) int {
	entries, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(entries)
}

func TestClientClosingMidRequestLeaksNoFD(t *testing.T) {
	started := make(chan struct{}, 1)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("X-Signal") != "" {
			started <- struct{}{}
		}
		_, _ = io.Copy(io.Discard, r.Body)
	}))
	t.Cleanup(srv.Close)
	proxy := startProxy(t, srv.Listener.Addr().String())
	// A whole request first on a connection that stays open, so that the baseline holds
	// it and a pooled backend connection, and nothing is closing while it is counted.
	kept := dial(t, proxy)
	exchange := func() {
		if resp, _ := kept.do("GET", "GET / HTTP/1.1\r\nHost: x\r\n\r\n"); resp.StatusCode != 200 {
			t.Fatalf("got %d", resp.StatusCode)
		}
	}
	exchange()
	before := openFDs(t)
	for range 3 {
		c := dial(t, proxy)
		_, _ = io.WriteString(c.conn, "POST /generate HTTP/1.1\r\nHost: x\r\nX-Signal: 1\r\nContent-Length: 100\r\n\r\nhalf")
		<-started // the backend has the head: the proxy holds the client and a backend socket
		c.conn.Close()
	}
	exchange() // if an aborted request took the pooled backend socket, it was closed: this opens a new one
	deadline := time.Now().Add(5 * time.Second)
	for openFDs(t) != before && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if after := openFDs(t); after != before {
		t.Fatalf("open descriptors %d before 3 abandoned requests, %d after", before, after)
	}
}
