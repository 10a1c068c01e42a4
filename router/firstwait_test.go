package router

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/pdrouter/pdrouter/balancer"
	"github.com/pdrouter/pdrouter/mock/mockworker"
)

// parkedStreams counts the router's h2c streams parked without a
// goroutine (parkH2C): before any first event, those waiting for it.
func parkedStreams(srv *Server) int {
	h := srv.upstream.h2c
	h.mu.Lock()
	defer h.mu.Unlock()
	n := 0
	for _, p := range h.pools {
		for _, c := range p.conns {
			c.mu.Lock()
			for _, st := range c.streams {
				if st.waiter != nil {
					n++
				}
			}
			c.mu.Unlock()
		}
	}
	return n
}

// h2cConns counts the router's h2c connections.
func h2cConns(srv *Server) int {
	h := srv.upstream.h2c
	h.mu.Lock()
	defer h.mu.Unlock()
	n := 0
	for _, p := range h.pools {
		n += len(p.conns)
	}
	return n
}

// PD streams waiting for their first token over h2c hold no router
// goroutine and no fasthttp RequestCtx: each parks on its h2c stream, and
// its hijack handler returns. On the old code each waited in its hijack
// handler (awaitH2C), ctx and all: no stream was parked.
func TestWaitingForTheFirstTokenHoldsNoGoroutineNorRequestCtx(t *testing.T) {
	defer func(rate int) { runtime.MemProfileRate = rate }(runtime.MemProfileRate)
	runtime.MemProfileRate = 1
	base, srv, _, _ := h2cPD(t, mockworker.Config{}, mockworker.Config{PrefillDelay: time.Minute})
	warm := sendStream(t, base, 3) // the engine connections up
	waitFor(t, func() bool { return parkedStreams(srv) == 1 })
	warm.Close()
	waitFor(t, func() bool { return srv.live.Load() == 0 && h2cIdle(srv) })
	fds, conns0 := openFDs(t), h2cConns(srv)
	goroutines := routerGoroutines()
	ctxHeap := heapFrom("fasthttp.(*Server).acquireCtx")
	const streams = 200
	conns := make([]net.Conn, streams)
	for i := range conns {
		conns[i] = sendStream(t, base, 3)
		defer conns[i].Close()
	}
	waitFor(t, func() bool { return parkedStreams(srv) == streams })
	waitFor(t, func() bool { return countStacks(routerStacks(), "fasthttp.hijackConnHandler") == 0 })
	if n := countStacks(routerStacks(), "(*upstreamResponse).awaitH2C"); n != 0 {
		t.Errorf("%d goroutines wait in awaitH2C, want none", n)
	}
	// The engine connections' readers and writers, and fasthttp's
	// goroutines of the set-up still exiting; none per stream.
	extra := func() int { return routerGoroutines() - goroutines }
	for deadline := time.Now().Add(5 * time.Second); extra() > streams/10 && time.Now().Before(deadline); {
		time.Sleep(20 * time.Millisecond)
	}
	if got := extra(); got > streams/10 {
		t.Errorf("%d more router goroutines with %d streams waiting for their first token, want none per stream", got, streams)
	}
	held := float64(heapFrom("fasthttp.(*Server).acquireCtx")-ctxHeap) / streams
	t.Logf("%.0f bytes of fasthttp RequestCtx per stream waiting for its first token", held)
	if held > 256 {
		t.Errorf("a stream waiting for its first token holds %.0f bytes of fasthttp RequestCtx, want none", held)
	}
	for _, c := range conns {
		c.Close()
	}
	waitFor(t, func() bool { return srv.live.Load() == 0 && h2cIdle(srv) })
	// A connection the burst added to an engine (before its SETTINGS said
	// how many streams one takes) stays pooled until idle: its two
	// descriptors (both ends, the engine in process) and its reader and
	// writer are no stream's.
	left := func() (int, int) {
		srv.infoCalls.CloseIdleConnections() // the engine aborts' keep-alive connections
		added := h2cConns(srv) - conns0
		return openFDs(t) - fds - 2*added, extra() - 2*added
	}
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		if n, g := left(); n <= 0 && g <= 0 {
			break
		}
	}
	if n, g := left(); n > 0 || g > 0 {
		t.Errorf("%d descriptors and %d goroutines more once the streams ended, want none", n, g)
	}
}

// streamHead sends a streamed /generate with header (extra lines) on a
// connection of its own and returns the response's head lines, Date left
// and the engine's id left out, and its body.
func streamHead(t *testing.T, base, proto, header string) ([]string, string) {
	t.Helper()
	c, err := net.Dial("tcp", strings.TrimPrefix(base, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	body := `{"text":"a b c","stream":true,"sampling_params":{"max_new_tokens":3}}`
	fmt.Fprintf(c, "POST /generate %s\r\nHost: r\r\nConnection: close\r\n%sContent-Length: %d\r\n\r\n%s", proto, header, len(body), body)
	b, err := io.ReadAll(c)
	if err != nil {
		t.Fatal(err)
	}
	head, rest, _ := strings.Cut(string(b), "\r\n\r\n")
	var lines []string
	for _, l := range strings.Split(head, "\r\n") {
		if !strings.HasPrefix(l, "Date: ") && !strings.HasPrefix(l, "X-Worker-Id: ") { // the engine's
			lines = append(lines, l)
		}
	}
	return lines, rest
}

// A stream answered by its continuation, after it was parked, gets the
// head and events a stream whose first token was in at once gets: its id,
// CORS headers, framing by HTTP version, every event.
func TestParkedStreamAnswersAsAnyStream(t *testing.T) {
	quick, _, _, _ := h2cPD(t, mockworker.Config{}, mockworker.Config{Tokens: 3})
	slow, srv, _, _ := h2cPD(t, mockworker.Config{}, mockworker.Config{Tokens: 3, PrefillDelay: 300 * time.Millisecond})
	for _, proto := range []string{"HTTP/1.1", "HTTP/1.0"} {
		header := "X-Request-Id: client-id-1\r\nOrigin: http://example.com\r\n"
		want, wantBody := streamHead(t, quick, proto, header)
		got, gotBody := streamHead(t, slow, proto, header)
		if strings.Join(got, "\n") != strings.Join(want, "\n") {
			t.Errorf("%s: a parked stream's head is\n%s\nwant\n%s", proto, strings.Join(got, "\n"), strings.Join(want, "\n"))
		}
		if strings.Count(gotBody, "data: ") != strings.Count(wantBody, "data: ") || !strings.Contains(gotBody, "data: [DONE]") {
			t.Errorf("%s: a parked stream's body is %q, want one like %q", proto, gotBody, wantBody)
		}
	}
	waitFor(t, func() bool { return srv.live.Load() == 0 && h2cIdle(srv) })
}

// cuttable is a TCP proxy to addr whose connections cut closes at once,
// as a worker's host going away would: no clean end of any stream.
type cuttable struct {
	ln    net.Listener
	mu    sync.Mutex
	conns []net.Conn
}

func newCuttable(t *testing.T, addr string) *cuttable {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	p := &cuttable{ln: ln}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			up, err := net.Dial("tcp", addr)
			if err != nil {
				c.Close()
				continue
			}
			p.mu.Lock()
			p.conns = append(p.conns, c, up)
			p.mu.Unlock()
			go func() { io.Copy(up, c); up.Close() }()
			go func() { io.Copy(c, up); c.Close() }()
		}
	}()
	return p
}

func (p *cuttable) url() string { return "http://" + p.ln.Addr().String() }

func (p *cuttable) cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range p.conns {
		c.Close()
	}
}

// A decode leg that fails while its stream is parked for the first token
// (its connection cut) is retried on another pair, as before the park;
// the client sees only the good stream.
func TestParkedStreamRetriesAFailedDecode(t *testing.T) {
	bad, err := mockworker.Start(mockworker.Config{Role: mockworker.RoleDecode, HTTP2: true, PrefillDelay: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	defer bad.Close()
	link := newCuttable(t, bad.Addr())
	base, srv, _, good := h2cPDWith(t, mockworker.Config{}, mockworker.Config{Tokens: 3}, func(c *Config) {
		c.Decode = append(c.Decode, link.url())
		c.DecodePolicy = "round_robin"
	})
	waitFor(t, func() bool { return len(srv.reg.Snapshot().Available(balancer.Decode)) == 2 })
	streams := 0
	for len(bad.Requests()) == 0 { // round robin: one of two streams is the bad decode's
		streams++
		type result struct {
			events []string
			err    error
		}
		done := make(chan result, 1)
		go func() {
			events, err := streamTokens(t.Context(), base, 3)
			done <- result{events, err}
		}()
		for parkedStreams(srv) == 0 && len(done) == 0 {
			time.Sleep(time.Millisecond)
		}
		if len(bad.Requests()) > 0 {
			waitFor(t, func() bool { return parkedStreams(srv) == 1 })
			link.cut()
		}
		res := <-done
		if res.err != nil || len(res.events) != 4 || res.events[3] != "[DONE]" {
			t.Fatalf("%q, %v; want 3 tokens and [DONE]", res.events, res.err)
		}
	}
	if n, m := len(bad.Requests()), len(good.Requests()); n != 1 || m != streams {
		t.Errorf("the bad decode got %d streams and the good one %d, want 1 and all %d", n, m, streams)
	}
	waitFor(t, func() bool { return srv.live.Load() == 0 && h2cIdle(srv) })
}

// Prefill failing (its connection cut) while decode's stream is parked for
// its first token is answered as before the park: prefill's error as JSON,
// nothing having been sent yet.
func TestParkedStreamAnswersPrefillFailure(t *testing.T) {
	prefill, err := mockworker.Start(mockworker.Config{Role: mockworker.RolePrefill, HTTP2: true, PrefillDelay: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	defer prefill.Close()
	link := newCuttable(t, prefill.Addr())
	base, srv, _, d := h2cPDWith(t, mockworker.Config{}, mockworker.Config{PrefillDelay: time.Minute}, func(c *Config) {
		c.Prefill[0].URL = link.url()
		c.Retry.MaxRetries = 1 // prefill's failure is the answer
	})
	waitFor(t, func() bool { return len(srv.reg.Snapshot().Available(balancer.Prefill)) == 1 })
	type answer struct {
		status int
		ctype  string
		body   string
		err    error
	}
	done := make(chan answer, 1)
	go func() {
		resp, err := http.Post(base+"/generate", "application/json", strings.NewReader(`{"text":"a","stream":true}`))
		if err != nil {
			done <- answer{err: err}
			return
		}
		b, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		done <- answer{resp.StatusCode, resp.Header.Get("Content-Type"), string(b), err}
	}()
	waitFor(t, func() bool { return parkedStreams(srv) == 1 && len(prefill.Requests()) == 1 })
	link.cut()
	a := <-done
	if a.err != nil || a.status != 502 || a.ctype != "application/json" || !strings.Contains(a.body, `"code":"prefill_server_error"`) {
		t.Fatalf("status %d %s: %s, %v; want prefill's 502 as JSON", a.status, a.ctype, a.body, a.err)
	}
	waitFor(t, func() bool { return len(d.Aborts()) == 1 }) // decode's leg was cut short
	waitFor(t, func() bool { return srv.live.Load() == 0 && h2cIdle(srv) })
}

// A client that leaves while its stream is parked for the first token
// cancels both legs, and both engines hear the abort.
func TestParkedStreamClientGoneAbortsBothLegs(t *testing.T) {
	base, srv, p, d := h2cPD(t, mockworker.Config{PrefillDelay: time.Minute}, mockworker.Config{PrefillDelay: time.Minute})
	c := sendStream(t, base, 3)
	waitFor(t, func() bool { return parkedStreams(srv) == 1 })
	c.Close()
	waitFor(t, func() bool { return len(p.Aborts()) == 1 && len(d.Aborts()) == 1 })
	if p.Aborts()[0].RID != d.Aborts()[0].RID {
		t.Errorf("aborts of %q (prefill) and %q (decode), want the one rid", p.Aborts()[0].RID, d.Aborts()[0].RID)
	}
	waitFor(t, func() bool { return srv.live.Load() == 0 && h2cIdle(srv) })
}

// The stream idle timeout covers the wait for the first token of a parked
// stream: the client gets the 504, both legs end, and both engines hear
// the abort (decode's did not: its leg closed before the request ended).
func TestParkedStreamIdleTimeout(t *testing.T) {
	base, srv, p, d := h2cPDWith(t, mockworker.Config{PrefillDelay: time.Minute}, mockworker.Config{PrefillDelay: time.Minute}, func(c *Config) {
		c.StreamIdleTimeout = 300 * time.Millisecond
	})
	start := time.Now()
	resp, err := http.Post(base+"/generate", "application/json", strings.NewReader(`{"text":"a","stream":true}`))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 504 || !strings.Contains(string(b), `"code":"stream_idle_timeout"`) {
		t.Fatalf("status %d: %s; want a 504 stream_idle_timeout", resp.StatusCode, b)
	}
	if took := time.Since(start); took > 5*time.Second {
		t.Errorf("answered after %v, want about the idle timeout", took)
	}
	waitFor(t, func() bool { return len(p.Aborts()) == 1 && len(d.Aborts()) == 1 })
	waitFor(t, func() bool { return srv.live.Load() == 0 && h2cIdle(srv) })
}

// Streams parked for their first token when the shutdown's grace period
// ends are told so, and leave nothing behind.
func TestParkedStreamsAtShutdown(t *testing.T) {
	base, srv, _, _ := h2cPD(t, mockworker.Config{}, mockworker.Config{PrefillDelay: time.Minute})
	const streams = 20
	conns := make([]net.Conn, streams)
	for i := range conns {
		conns[i] = sendStream(t, base, 3)
		defer conns[i].Close()
	}
	waitFor(t, func() bool { return parkedStreams(srv) == streams })
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	srv.Shutdown(ctx) //nolint:errcheck // the grace period ends with the streams waiting
	for i, c := range conns {
		c.SetReadDeadline(time.Now().Add(10 * time.Second))
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			t.Fatalf("stream %d: %v", i, err)
		}
		b, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != 503 || !strings.Contains(string(b), `"code":"server_shutting_down"`) {
			t.Fatalf("stream %d: status %d: %s; want the shutdown's 503", i, resp.StatusCode, b)
		}
	}
	waitFor(t, func() bool { return srv.live.Load() == 0 && h2cIdle(srv) })
}

// What a parked stream keeps of its RequestCtx is a copy, and all of what
// the rest of it reads: once ctx is reused for another request, the body,
// the headers policies read, the id and the response's header fields are
// still the parked request's.
func TestParkedRequestOwnsItsCopy(t *testing.T) {
	var ctx fasthttp.RequestCtx
	ctx.Request.Header.SetProtocol("HTTP/1.0")
	ctx.Request.Header.Set("X-SMG-Routing-Key", "key-1")
	ctx.Request.SetBodyString(`{"text":"a","stream":true}`)
	ctx.Response.Header.Set("X-Request-Id", "id-1")
	ctx.Response.Header.Set("Access-Control-Allow-Origin", "*")
	r := &request{body: ctx.PostBody(), requestID: ctx.Response.Header.Peek("X-Request-Id")}
	r.ownCopy(&ctx)
	ctx.Request.Reset() // fasthttp's next request
	ctx.Response.Reset()
	ctx.Request.SetBodyString(`{"text":"b","stream":false}`)
	ctx.Request.Header.Set("X-SMG-Routing-Key", "key-2")
	ctx.Response.Header.Set("X-Request-Id", "id-2")
	if got := string(r.body); got != `{"text":"a","stream":true}` {
		t.Errorf("body %q after ctx was reused", got)
	}
	if got := string(r.requestID); got != "id-1" {
		t.Errorf("request id %q after ctx was reused", got)
	}
	if got := r.clientHeaders(&ctx).Get("x-smg-routing-key"); got != "key-1" {
		t.Errorf("policies see X-SMG-Routing-Key %q, want the parked request's", got)
	}
	if got := r.clientHeaders(&ctx).Get("X-Absent"); got != "" {
		t.Errorf("an absent header reads %q", got)
	}
	answer := r.park.answerCtx()
	defer releaseAnswerCtx(answer)
	if answer.Request.Header.IsHTTP11() {
		t.Error("the answer is framed for HTTP/1.1, the client spoke HTTP/1.0")
	}
	h := &answer.Response.Header
	if id, origin := string(h.Peek("X-Request-Id")), string(h.Peek("Access-Control-Allow-Origin")); id != "id-1" || origin != "*" {
		t.Errorf("the answer's X-Request-Id %q and Access-Control-Allow-Origin %q, want the parked response's", id, origin)
	}
	r.park.over(true)
}
