package router

import (
	"bufio"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pdrouter/pdrouter/balancer"
	"github.com/pdrouter/pdrouter/router/splice"
)

// serverConns is a test server's view of the connections it accepted.
type serverConns struct {
	mu       sync.Mutex
	accepted int
	open     map[string]bool // by the client's address
}

func (c *serverConns) count() (accepted, open int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.accepted, len(c.open)
}

func (c *serverConns) acceptedCount() int { n, _ := c.count(); return n }
func (c *serverConns) openCount() int     { _, n := c.count(); return n }

// countingServer counts the connections it accepts and those still open.
func countingServer(t *testing.T, h http.HandlerFunc) (*httptest.Server, *serverConns) {
	t.Helper()
	conns := &serverConns{open: map[string]bool{}}
	srv := httptest.NewUnstartedServer(h)
	srv.Config.ConnState = func(c net.Conn, s http.ConnState) {
		conns.mu.Lock()
		defer conns.mu.Unlock()
		switch s {
		case http.StateNew:
			conns.accepted++
			conns.open[c.RemoteAddr().String()] = true
		case http.StateClosed, http.StateHijacked:
			delete(conns.open, c.RemoteAddr().String())
		}
	}
	srv.Start()
	t.Cleanup(srv.Close)
	return srv, conns
}

func TestUpstreamReusesConnections(t *testing.T) {
	srv, conns := countingServer(t, func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		if r.Header.Get("X-Test") != "1" || r.Header.Get("Content-Type") != "application/json" {
			w.WriteHeader(400)
		}
		if strings.Contains(r.URL.Path, "chunked") {
			w.(http.Flusher).Flush() // forces chunked framing
		}
		w.Write(b)
	})
	u := newUpstream(DefaultConfig().UpstreamIdleTimeout)
	defer u.close()
	for i, path := range []string{"/a", "/chunked", "/b", "/chunked", "/c"} {
		resp, err := u.post(&scope{}, srv.URL, path, bodyOf([]byte(`{"i":1}`)), []byte("X-Test: 1\r\n"), nil)
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		body, err := io.ReadAll(resp)
		resp.Close()
		if err != nil || resp.StatusCode != 200 || string(body) != `{"i":1}` {
			t.Fatalf("request %d: %d %q %v", i, resp.StatusCode, body, err)
		}
	}
	if n := conns.acceptedCount(); n != 1 {
		t.Errorf("5 sequential requests used %d connections, want 1", n)
	}
}

func TestUpstreamRetriesAConnectionClosedWhileIdle(t *testing.T) {
	srv, conns := countingServer(t, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") })
	u := newUpstream(DefaultConfig().UpstreamIdleTimeout)
	defer u.close()
	for i := range 2 {
		resp, err := u.post(&scope{}, srv.URL, "/", bodyOf(nil), nil, nil)
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		io.Copy(io.Discard, resp)
		resp.Close()
		srv.CloseClientConnections() // the worker drops its idle keep-alive connection
		time.Sleep(20 * time.Millisecond)
	}
	if n := conns.acceptedCount(); n != 2 {
		t.Errorf("want a fresh connection after the idle one was closed: %d", n)
	}
}

// A worker that restarts leaves every pooled connection dead: the retry
// after the first one fails goes out on a fresh connection, not on the
// next dead one.
func TestUpstreamRetryAfterAStaleConnectionDials(t *testing.T) {
	srv, conns := countingServer(t, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") })
	u := newUpstream(DefaultConfig().UpstreamIdleTimeout)
	defer u.close()
	var held []*upstreamResponse // in use together: each takes a connection of its own
	for i := range 2 {
		resp, err := u.post(&scope{}, srv.URL, "/", bodyOf(nil), nil, nil)
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		held = append(held, resp)
	}
	for _, resp := range held {
		io.Copy(io.Discard, resp)
		resp.Close()
	}
	u.mu.Lock()
	pooled := len(u.idle[strings.TrimPrefix(srv.URL, "http://")])
	u.mu.Unlock()
	if pooled != 2 {
		t.Fatalf("%d pooled connections, want 2", pooled)
	}
	srv.CloseClientConnections()
	waitFor(t, func() bool { return conns.openCount() == 0 })
	resp, err := u.post(&scope{}, srv.URL, "/", bodyOf(nil), nil, nil)
	if err != nil {
		t.Fatalf("with every pooled connection closed by the worker: %v", err)
	}
	io.Copy(io.Discard, resp)
	resp.Close()
}

func TestUpstreamCancelEndsAWaitAndDropsTheConnection(t *testing.T) {
	release := make(chan struct{})
	srv, conns := countingServer(t, func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-release:
		case <-r.Context().Done():
		}
	})
	defer close(release)
	u := newUpstream(DefaultConfig().UpstreamIdleTimeout)
	defer u.close()
	ctx := &scope{}
	cause := errors.New("other leg failed")
	time.AfterFunc(50*time.Millisecond, func() { ctx.cancel(cause) })
	start := time.Now()
	_, err := u.post(ctx, srv.URL, "/", bodyOf(nil), nil, nil)
	if !errors.Is(err, cause) || time.Since(start) > 2*time.Second {
		t.Fatalf("err %v after %v, want the cancel cause at once", err, time.Since(start))
	}
	resp, err := u.post(&scope{}, srv.URL+"x", "/", bodyOf(nil), nil, nil)
	if err == nil {
		resp.Close()
		t.Fatal("a malformed URL must fail")
	}
	if n := conns.acceptedCount(); n != 1 {
		t.Errorf("connections %d", n)
	}
	if len(u.idle) != 0 && len(u.idle[strings.TrimPrefix(srv.URL, "http://")]) != 0 {
		t.Error("a cancelled connection went back to the pool")
	}
}

func TestUpstreamHalfReadBodyIsNotReused(t *testing.T) {
	srv, conns := countingServer(t, func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, strings.Repeat("x", 100000))
	})
	u := newUpstream(DefaultConfig().UpstreamIdleTimeout)
	defer u.close()
	for range 2 {
		resp, err := u.post(&scope{}, srv.URL, "/", bodyOf(nil), nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, 10)
		resp.Read(buf)
		resp.Close()
	}
	if n := conns.acceptedCount(); n != 2 {
		t.Errorf("a connection with unread body was reused: %d connections", n)
	}
}

// A worker that sends bytes past its reply's end (a wrong Content-Length)
// leaves its connection out of step: pooled, the next request would read
// those bytes as its reply.
func TestUpstreamDoesNotPoolAConnectionWithBytesPastItsReply(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var served sync.WaitGroup
	defer served.Wait()
	defer ln.Close()
	served.Add(1)
	go func() {
		defer served.Done()
		for first := true; ; first = false {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			served.Add(1)
			go func(c net.Conn, reply string) {
				defer served.Done()
				defer c.Close()
				br := bufio.NewReader(c)
				for {
					for { // the request head; post sends no body here
						line, err := br.ReadString('\n')
						if err != nil {
							return
						}
						if line == "\r\n" {
							break
						}
					}
					if _, err := io.WriteString(c, reply); err != nil {
						return
					}
					reply = "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nfresh"
				}
			}(c, map[bool]string{
				true:  "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokHTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nstale",
				false: "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nfresh",
			}[first])
		}
	}()
	u := newUpstream(DefaultConfig().UpstreamIdleTimeout)
	defer u.close()
	for i, want := range []string{"ok", "fresh"} {
		resp, err := u.post(&scope{}, "http://"+ln.Addr().String(), "/", bodyOf(nil), nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		got, err := io.ReadAll(resp)
		resp.Close()
		if err != nil || string(got) != want {
			t.Fatalf("reply %d: %q %v, want %q", i, got, err, want)
		}
	}
}

func TestHostPort(t *testing.T) {
	for in, want := range map[string][3]string{
		"http://10.0.0.1:30000":   {"10.0.0.1:30000", "10.0.0.1:30000", ""},
		"http://[::1]:8000":       {"[::1]:8000", "[::1]:8000", ""},
		"http://worker":           {"worker:80", "worker", ""},
		"https://w.example/base":  {"w.example:443", "w.example", "w.example"},
		"https://[fe80::1]:8443/": {"[fe80::1]:8443", "[fe80::1]:8443", "fe80::1"},
	} {
		addr, host, tlsHost, err := hostPort(in)
		if err != nil || [3]string{addr, host, tlsHost} != want {
			t.Errorf("%s: %q %q %q %v, want %q", in, addr, host, tlsHost, err, want)
		}
	}
	if _, _, _, err := hostPort("ftp://x"); err == nil {
		t.Error("ftp accepted")
	}
}

// The registered workers' URLs are split once, as hostPort splits them;
// any other URL (a worker that just left) is still split when it is used.
func TestUpstreamEndpointsFollowTheRegistry(t *testing.T) {
	u := newUpstream(DefaultConfig().UpstreamIdleTimeout)
	defer u.close()
	reg := balancer.NewRegistry()
	reg.OnChange(func(s *balancer.Snapshot) { u.follow(s) })
	a, b := "https://[fe80::1]:8443", "http://worker"
	reg.Add(balancer.NewWorker(a, balancer.Regular, balancer.NoBootstrapPort))
	reg.Add(balancer.NewWorker(b, balancer.Regular, balancer.NoBootstrapPort))
	reg.Remove(b)
	if m := *u.endpoints.Load(); len(m) != 1 || m[a] != (endpoint{"[fe80::1]:8443", "[fe80::1]:8443", "fe80::1"}) {
		t.Fatalf("endpoints %v, want only %s's, split", m, a)
	}
	for _, url := range []string{a, b} {
		addr, host, tlsHost, err := u.endpoint(url)
		wa, wh, wt, werr := hostPort(url)
		if [3]string{addr, host, tlsHost} != [3]string{wa, wh, wt} || err != werr {
			t.Errorf("%s: %q %q %q %v, want hostPort's %q %q %q %v", url, addr, host, tlsHost, err, wa, wh, wt, werr)
		}
	}
	if _, _, _, err := u.endpoint("ftp://x"); err == nil {
		t.Error("ftp accepted")
	}
}

func TestUpstreamClosesIdleConnections(t *testing.T) {
	srv, conns := countingServer(t, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") })
	u := newUpstream(DefaultConfig().UpstreamIdleTimeout)
	defer u.close()
	u.idleTimeout = 50 * time.Millisecond
	for range 2 { // the second reuses the first's connection and rearms the reaper
		resp, err := u.post(&scope{}, srv.URL, "/", bodyOf(nil), nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp)
		resp.Close()
	}
	if accepted, open := conns.count(); accepted != 1 || open != 1 {
		t.Fatalf("accepted %d, open %d: want one pooled connection", accepted, open)
	}
	waitFor(t, func() bool { return conns.openCount() == 0 })
	u.mu.Lock()
	defer u.mu.Unlock()
	if len(u.idle) != 0 || u.reaping {
		t.Errorf("after the idle timeout: pool %v, reaper armed %v", u.idle, u.reaping)
	}
}

func TestUpstreamPoolsOnlyRegisteredWorkers(t *testing.T) {
	release := make(chan struct{})
	handler := func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/slow" {
			<-release
		}
		io.WriteString(w, "ok")
	}
	gone, goneConns := countingServer(t, handler)
	stays, staysConns := countingServer(t, handler)
	t.Cleanup(func() { // before the servers close, which waits for handlers
		select {
		case <-release:
		default:
			close(release)
		}
	})
	reg := balancer.NewRegistry()
	for _, u := range []string{gone.URL, stays.URL} {
		reg.Add(balancer.NewWorker(u, balancer.Regular, balancer.NoBootstrapPort))
	}
	u := newUpstream(DefaultConfig().UpstreamIdleTimeout)
	defer u.close()
	reg.OnChange(func(s *balancer.Snapshot) { u.follow(s) })
	get := func(base, path string) {
		resp, err := u.post(&scope{}, base, path, bodyOf(nil), nil, nil)
		if err != nil {
			t.Error(err)
			return
		}
		io.Copy(io.Discard, resp)
		resp.Close()
	}
	busy := make(chan struct{})
	go func() { defer close(busy); get(gone.URL, "/slow") }() // in use while its worker leaves
	waitFor(t, func() bool { return goneConns.openCount() == 1 })
	get(gone.URL, "/") // a second connection, left idle
	get(stays.URL, "/")
	if _, open := goneConns.count(); open != 2 {
		t.Fatalf("%d connections open to the leaving worker, want a busy and an idle one", open)
	}

	reg.Remove(gone.URL)
	waitFor(t, func() bool { return goneConns.openCount() == 1 }) // the idle one
	close(release)
	<-busy
	waitFor(t, func() bool { return goneConns.openCount() == 0 }) // the busy one, once done
	if _, open := staysConns.count(); open != 1 {
		t.Errorf("the registered worker's idle connection: %d open, want 1", open)
	}
	u.mu.Lock()
	defer u.mu.Unlock()
	if n := len(u.idle[strings.TrimPrefix(gone.URL, "http://")]); n != 0 {
		t.Errorf("%d connections of a removed worker pooled", n)
	}
}

// bodyOf is b as an unedited upstream body.
func bodyOf(b []byte) *splice.Body {
	var body splice.Body
	body.Reset(b)
	return &body
}

// Row 12: a stalled worker makes a burst of connections (one per request
// waiting on it). Once it answers they go back to the pool, capped per
// worker, and the pool shrinks to nothing at the idle timeout instead of
// keeping the burst's sockets open.
func TestUpstreamPoolShrinksAfterABurst(t *testing.T) {
	stall := make(chan struct{})
	srv, conns := countingServer(t, func(w http.ResponseWriter, r *http.Request) {
		<-stall
		io.WriteString(w, "ok")
	})
	u := newUpstream(200 * time.Millisecond)
	u.maxIdle = 10
	defer u.close()
	const burst = 40
	var wg sync.WaitGroup
	for range burst {
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp, err := u.post(&scope{}, srv.URL, "/", bodyOf(nil), nil, nil)
			if err != nil {
				t.Error(err)
				return
			}
			io.Copy(io.Discard, resp)
			resp.Close()
		}()
	}
	waitFor(t, func() bool { return conns.openCount() == burst })
	close(stall)
	wg.Wait()
	if open := conns.openCount(); open > u.maxIdle {
		// The server may see a close a moment late: wait for it.
		waitFor(t, func() bool { return conns.openCount() <= u.maxIdle })
	}
	u.mu.Lock()
	pooled := len(u.idle[strings.TrimPrefix(srv.URL, "http://")])
	u.mu.Unlock()
	if pooled != u.maxIdle {
		t.Fatalf("%d connections pooled after the burst, want the cap %d", pooled, u.maxIdle)
	}
	waitFor(t, func() bool { return conns.openCount() == 0 })
	u.mu.Lock()
	defer u.mu.Unlock()
	if len(u.idle) != 0 || u.reaping {
		t.Errorf("after the idle timeout: pool %v, reaper armed %v", u.idle, u.reaping)
	}
}

// A prefill not yet writing when the reply is over gets a copy of the body:
// the client's buffer may be reused at once, and the worker still gets
// the client's bytes. One writing is cut (cancel) and waited for.
func TestWriteGuardRelease(t *testing.T) {
	got := make(chan string, 1)
	srv, _ := countingServer(t, func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		got <- string(b)
	})
	u := newUpstream(DefaultConfig().UpstreamIdleTimeout)
	defer u.close()

	src := []byte(`{"text":"client"}`)
	body := bodyOf(src)
	var g writeGuard
	g.release(body, func() { t.Error("cancelled with no write under way") })
	copy(src, `{"text":"REUSED"}`) // fasthttp's next request
	resp, err := u.post(&scope{}, srv.URL, "/", body, nil, &g)
	if err != nil {
		t.Fatal(err)
	}
	resp.Close()
	if b := <-got; b != `{"text":"client"}` {
		t.Fatalf("worker got %q", b)
	}

	// Released after a write: a retry may not read the buffer again.
	var done writeGuard
	if !done.begin() {
		t.Fatal("begin refused before release")
	}
	done.end()
	done.release(bodyOf(src), func() { t.Error("cancelled with no write under way") })
	if done.begin() {
		t.Fatal("a write began after release on a written body")
	}

	// Released during a write that ends soon (a socket buffer taking it):
	// release waits for it and does not cut it.
	var quick writeGuard
	quick.begin()
	go func() { time.Sleep(5 * time.Millisecond); quick.end() }()
	quick.release(bodyOf(src), func() { t.Error("a write ending within the grace was cut") })

	// Released during a write that does not end: cancel ends it, release
	// waits for it.
	var busy writeGuard
	busy.begin()
	cancelled := make(chan struct{})
	go func() { <-cancelled; busy.end() }()
	busy.release(bodyOf(src), func() { close(cancelled) })
	select {
	case <-cancelled:
	default:
		t.Fatal("a write under way was not cancelled")
	}
}

func TestWholeChunk(t *testing.T) {
	for _, c := range []struct {
		in   string
		want bool
	}{
		{"5\r\nhello\r\n", true},
		{"5\r\nhello\r\n7\r\npartial", true}, // the first is whole; the rest waits
		{"A;ext=1\r\n0123456789\r\n", true},
		{"5\r\nhello\r", false}, // its CRLF is still to come
		{"5\r\nhel", false},
		{"5\r", false},
		{"1", false},
		{"", false},
		{"0\r\n\r\n", false},          // the last chunk: its trailer is the next read's
		{"5\nhello\r\n", false},       // no CR: fasthttp's error to report
		{"\r\n5\r\nhello\r\n", false}, // not at a size line
		{"zz\r\nhello\r\n", false},    // not a size
		{"123456789\r\nx\r\n", false}, // too long a size to be real
		{"5 \r\nhello\r\n", true},     // whitespace before the CRLF is fasthttp's to judge
		{"10\r\n0123456789abcde\r\n", false},
	} {
		if got := wholeChunk([]byte(c.in)); got != c.want {
			t.Errorf("wholeChunk(%q) = %v, want %v", c.in, got, c.want)
		}
	}
}

// A request's reply is read with one system call: none is tried before the
// reply can have come (before: one that found nothing, then the wait, then
// the read). The worker answers 20 ms late, by hand, so that its own reads
// are known: one for each request.
func TestUpstreamReadsAReplyOnce(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	next := make(chan bool, 1) // the worker reads the next request when told
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		br := bufio.NewReader(c)
		for <-next {
			for {
				line, err := br.ReadString('\n')
				if err != nil {
					return
				}
				if line == "\r\n" {
					break
				}
			}
			time.Sleep(20 * time.Millisecond)
			io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
		}
	}()
	defer close(next)
	u := newUpstream(DefaultConfig().UpstreamIdleTimeout)
	defer u.close()
	post := func() {
		resp, err := u.post(&scope{}, "http://"+ln.Addr().String(), "/", bodyOf(nil), nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		if b, err := io.ReadAll(resp); err != nil || string(b) != "ok" {
			t.Fatalf("%q %v", b, err)
		}
		resp.Close()
	}
	next <- true
	post() // the connection is pooled
	fewest := 1 << 30
	for range 5 { // other goroutines' reads count too: the fewest is this one's
		next <- true
		time.Sleep(5 * time.Millisecond) // the worker waits in its read (well within warmReuse)
		own := readSyscalls(t)           // reading the count takes reads of its own
		before := readSyscalls(t)
		own = before - own
		post()
		fewest = min(fewest, readSyscalls(t)-before-own)
	}
	if fewest != 2 {
		t.Fatalf("%d read system calls for a request and its reply, want 2 (the worker's and the router's)", fewest)
	}
}

// A worker that half-closes an idle keep-alive connection (its FIN sent,
// its socket still open, so the router's next write draws no reset) must
// not hold the next request on it: the router reads that FIN before it
// waits for a reply, and retries on a fresh connection.
func TestUpstreamRetriesAConnectionHalfClosedWhileIdle(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var accepted []net.Conn
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		defer mu.Unlock()
		for _, c := range accepted {
			c.Close()
		}
	})
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			first := len(accepted) == 0
			accepted = append(accepted, c)
			mu.Unlock()
			go func() {
				br := bufio.NewReader(c)
				req, err := http.ReadRequest(br)
				if err != nil {
					return
				}
				io.Copy(io.Discard, req.Body)
				io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
				if first {
					time.Sleep(10 * time.Millisecond)
					c.(*net.TCPConn).CloseWrite()
					io.Copy(io.Discard, c) // reads on, answers nothing
				}
			}()
		}
	}()
	u := newUpstream(DefaultConfig().UpstreamIdleTimeout)
	defer u.close()
	url := "http://" + ln.Addr().String()
	for i := range 2 {
		got := make(chan error, 1)
		go func() {
			resp, err := u.post(&scope{}, url, "/", bodyOf(nil), nil, nil)
			if err == nil {
				_, err = io.Copy(io.Discard, resp)
				resp.Close()
			}
			got <- err
		}()
		select {
		case err := <-got:
			if err != nil {
				t.Fatalf("request %d: %v", i, err)
			}
		case <-time.After(3 * time.Second):
			t.Fatalf("request %d waits on a connection its worker half-closed", i)
		}
		time.Sleep(100 * time.Millisecond) // the FIN arrives while the connection idles
	}
	mu.Lock()
	n := len(accepted)
	mu.Unlock()
	if n != 2 {
		t.Errorf("want a fresh connection after the idle one was half-closed: %d", n)
	}
}
