package router

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	dto "github.com/prometheus/client_model/go"

	"github.com/pdrouter/pdrouter/mock/mockworker"
)

// recordingHost is a parkHost that notes what the lot did with each
// connection.
type recordingHost struct {
	mu     sync.Mutex
	served []net.Conn
	closed []net.Conn
	woke   chan struct{}
}

func newRecordingHost() *recordingHost { return &recordingHost{woke: make(chan struct{}, 16)} }

func (h *recordingHost) serveParked(c net.Conn) { h.note(&h.served, c) }
func (h *recordingHost) closeParked(c net.Conn) { h.note(&h.closed, c); c.Close() }

func (h *recordingHost) note(list *[]net.Conn, c net.Conn) {
	h.mu.Lock()
	*list = append(*list, c)
	h.mu.Unlock()
	select {
	case h.woke <- struct{}{}:
	default:
	}
}

func (h *recordingHost) counts() (served, closed int) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.served), len(h.closed)
}

// A parked connection is served when its client sends its next bytes
// (which are still there to read), and closed when the client closes or
// resets it; either way it leaves the lot and the epoll set.
func TestParkedConnWakesForBytesOrHangUp(t *testing.T) {
	ln := loopback(t)
	w := &watcher{}
	defer w.close()
	for _, c := range []struct {
		name       string
		act        func(net.Conn)
		wantServed bool
	}{
		{"next request", func(c net.Conn) { c.Write([]byte("GET / HTTP/1.1\r\n")) }, true},
		{"close", func(c net.Conn) { c.Close() }, false},
		{"reset", func(c net.Conn) { c.(*net.TCPConn).SetLinger(0); c.Close() }, false},
	} {
		client, server := tcpPair(t, ln)
		host := newRecordingHost()
		if !w.park(server, time.Minute, host) {
			t.Fatalf("%s: not parked", c.name)
		}
		time.Sleep(5 * time.Millisecond)
		if served, closed := host.counts(); served+closed != 0 || w.lot.parked() != 1 {
			t.Fatalf("%s: served %d, closed %d, %d parked before the client acted; want it parked", c.name, served, closed, w.lot.parked())
		}
		c.act(client)
		select {
		case <-host.woke:
		case <-time.After(5 * time.Second):
			t.Fatalf("%s: the parked connection never woke", c.name)
		}
		served, closed := host.counts()
		if c.wantServed && (served != 1 || closed != 0) || !c.wantServed && (served != 0 || closed != 1) {
			t.Errorf("%s: served %d, closed %d", c.name, served, closed)
		}
		if c.wantServed {
			server.SetReadDeadline(time.Now().Add(time.Second))
			if b, err := bufio.NewReader(server).ReadString('\n'); b != "GET / HTTP/1.1\r\n" {
				t.Errorf("%s: the server then read %q, %v; want the client's bytes", c.name, b, err)
			}
		}
		w.ep.mu.Lock()
		left := len(w.ep.parked)
		w.ep.mu.Unlock()
		if w.lot.parked() != 0 || left != 0 {
			t.Errorf("%s: %d in the lot, %d in the epoll set after the wake", c.name, w.lot.parked(), left)
		}
		client.Close()
		server.Close()
	}
}

// A connection parked longer than the idle timeout is closed, oldest
// first, each at its own time.
func TestParkedConnClosedWhenIdle(t *testing.T) {
	ln := loopback(t)
	w := &watcher{}
	defer w.close()
	w.epoller() // its goroutine outside the bubble: it waits on the network
	first, firstServer := tcpPair(t, ln)
	defer first.Close()
	second, secondServer := tcpPair(t, ln)
	defer second.Close()
	host := newRecordingHost()
	synctest.Test(t, func(t *testing.T) {
		if !w.park(firstServer, time.Minute, host) {
			t.Fatal("not parked")
		}
		time.Sleep(10 * time.Second)
		if !w.park(secondServer, time.Minute, host) {
			t.Fatal("not parked")
		}
		for _, step := range []struct {
			after      time.Duration
			wantClosed int
		}{{50*time.Second - time.Millisecond, 0}, {time.Millisecond, 1}, {10*time.Second - time.Millisecond, 1}, {time.Millisecond, 2}} {
			time.Sleep(step.after)
			synctest.Wait()
			if _, closed := host.counts(); closed != step.wantClosed || w.lot.parked() != 2-closed {
				t.Fatalf("closed %d, %d parked; want %d closed", closed, w.lot.parked(), step.wantClosed)
			}
		}
		host.mu.Lock()
		order := host.closed
		host.mu.Unlock()
		if order[0] != firstServer || order[1] != secondServer {
			t.Error("closed out of their order")
		}
		w.lot.closeAll() // its timer is the bubble's
	})
}

// closeAll (at shutdown) closes every parked connection, and one parked
// after it is closed at once; without epoll nothing is parked.
func TestParkingLotCloseAll(t *testing.T) {
	ln := loopback(t)
	w := &watcher{}
	defer w.close()
	host := newRecordingHost()
	var clients []net.Conn
	for range 3 {
		client, server := tcpPair(t, ln)
		defer client.Close()
		clients = append(clients, client)
		if !w.park(server, 0, host) {
			t.Fatal("not parked")
		}
	}
	w.lot.closeAll()
	client, server := tcpPair(t, ln)
	defer client.Close()
	if !w.park(server, time.Minute, host) {
		t.Fatal("a connection parked after closeAll was left to the caller, want it closed")
	}
	if served, closed := host.counts(); served != 0 || closed != 4 || w.lot.parked() != 0 {
		t.Fatalf("served %d, closed %d, %d parked; want all 4 closed", served, closed, w.lot.parked())
	}
	for _, c := range append(clients, client) {
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		if n, err := c.Read(make([]byte, 1)); n != 0 || err != io.EOF {
			t.Errorf("the client read %d bytes, %v; want EOF", n, err)
		}
	}
	noEpoll := &watcher{epErr: errors.ErrUnsupported}
	client, server = tcpPair(t, ln)
	defer client.Close()
	defer server.Close()
	if noEpoll.park(server, time.Minute, host) {
		t.Error("parked without epoll, want the connection left to the caller")
	}
}

// streamOn sends a streamed /generate of tokens tokens on c and reads its
// whole response, leaving the connection open.
func streamOn(t *testing.T, c net.Conn, br *bufio.Reader, tokens int) {
	t.Helper()
	body := fmt.Sprintf(`{"text":"a b c","stream":true,"sampling_params":{"max_new_tokens":%d}}`, tokens)
	fmt.Fprintf(c, "POST /generate HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	b, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != 200 || resp.Close || !strings.HasSuffix(string(b), "data: [DONE]\n\n") {
		t.Fatalf("status %d, close %v, err %v: %q", resp.StatusCode, resp.Close, err, b)
	}
}

// idleStreamConns opens n connections to base and runs a short stream on
// each, leaving them idle and open.
func idleStreamConns(t *testing.T, base string, n int) ([]net.Conn, []*bufio.Reader) {
	t.Helper()
	conns, readers := make([]net.Conn, n), make([]*bufio.Reader, n)
	for i := range conns {
		c, err := net.Dial("tcp", strings.TrimPrefix(base, "http://"))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		conns[i], readers[i] = c, bufio.NewReader(c)
		streamOn(t, c, readers[i], 3)
	}
	return conns, readers
}

func gaugeValue(t *testing.T, g interface{ Write(*dto.Metric) error }) float64 {
	t.Helper()
	var m dto.Metric
	if err := g.Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetGauge().GetValue()
}

// A client connection idle after a stream waits for its next request in
// the epoll set, holding no goroutine (fasthttp's ServeConn held one, and
// a RequestCtx, per connection on the old code), is counted open once,
// and serves the client's next request when it comes.
func TestIdleStreamConnHoldsNoGoroutine(t *testing.T) {
	const conns = 40
	base, srv, _, _ := h2cPD(t, mockworker.Config{}, mockworker.Config{})
	if _, err := streamTokens(context.Background(), base, 1); err != nil { // the engine connections are up
		t.Fatal(err)
	}
	http.DefaultClient.CloseIdleConnections()
	waitFor(t, func() bool { return srv.live.Load() == 0 && srv.inflight.watcher.lot.parked() == 0 })
	goroutines := routerGoroutines()
	cs, readers := idleStreamConns(t, base, conns)
	waitFor(t, func() bool { return srv.live.Load() == 0 })
	if got := routerGoroutines() - goroutines; got > conns/10 {
		t.Errorf("%d more router goroutines with %d idle connections after their streams, want none per connection", got, conns)
	}
	if n := countStacks(routerStacks(), "fasthttp.(*Server).serveConnCounted("); n != 0 {
		t.Errorf("%d idle connections wait in fasthttp's serveConn, want none", n)
	}
	if n := srv.inflight.watcher.lot.parked(); n != conns {
		t.Errorf("%d connections parked, want %d", n, conns)
	}
	if n := gaugeValue(t, srv.metrics.httpConnections); n != conns {
		t.Errorf("smg_http_connections = %v with %d connections open, want %d", n, conns, conns)
	}
	for i, c := range cs { // the next requests: a plain one, then a stream again
		body := `{"text":"a b c","sampling_params":{"max_new_tokens":3}}`
		fmt.Fprintf(c, "POST /generate HTTP/1.1\r\nHost: r\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
		resp, err := http.ReadResponse(readers[i], nil)
		if err != nil {
			t.Fatal(err)
		}
		b, err := io.ReadAll(resp.Body)
		if err != nil || resp.StatusCode != 200 || !strings.Contains(string(b), `"text"`) {
			t.Fatalf("the next request: status %d, err %v: %q", resp.StatusCode, err, b)
		}
		streamOn(t, c, readers[i], 2)
	}
	for _, c := range cs {
		c.Close()
	}
	waitFor(t, func() bool {
		return srv.inflight.watcher.lot.parked() == 0 && gaugeValue(t, srv.metrics.httpConnections) == 0
	})
	deadline := time.Now().Add(5 * time.Second)
	for routerGoroutines() > goroutines && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if g := routerGoroutines(); g > goroutines {
		t.Errorf("%d router goroutines after the clients left, %d before", g, goroutines)
	}
}

// The server's idle timeout (--idle-connection-timeout) closes a
// connection idle after a stream, as it does one idle after a plain
// request (the old code waited fasthttp's header read timeout instead).
func TestIdleStreamConnClosedAfterIdleTimeout(t *testing.T) {
	base, srv, _, _ := h2cPDWith(t, mockworker.Config{}, mockworker.Config{}, func(c *Config) {
		c.IdleConnectionTimeout = 200 * time.Millisecond
	})
	cs, readers := idleStreamConns(t, base, 3)
	start := time.Now()
	for i, c := range cs {
		c.SetReadDeadline(time.Now().Add(10 * time.Second))
		if n, err := readers[i].Read(make([]byte, 1)); n != 0 || err != io.EOF {
			t.Fatalf("the idle client read %d bytes, %v; want EOF", n, err)
		}
	}
	if took := time.Since(start); took > 5*time.Second {
		t.Errorf("closed after %v, want about the 200 ms idle timeout", took)
	}
	waitFor(t, func() bool {
		return srv.inflight.watcher.lot.parked() == 0 && gaugeValue(t, srv.metrics.httpConnections) == 0
	})
}

// Shutdown closes the connections idle after their streams at once, and
// returns without waiting on them.
func TestShutdownClosesIdleStreamConns(t *testing.T) {
	base, srv, _, _ := h2cPD(t, mockworker.Config{}, mockworker.Config{})
	cs, readers := idleStreamConns(t, base, 5)
	waitFor(t, func() bool { return srv.inflight.watcher.lot.parked() == len(cs) })
	start := time.Now()
	shutdown(t, srv)
	if took := time.Since(start); took > 3*time.Second {
		t.Errorf("Shutdown took %v with idle stream connections open", took)
	}
	for i, c := range cs {
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		if n, err := readers[i].Read(make([]byte, 1)); n != 0 || err != io.EOF {
			t.Errorf("after Shutdown the idle client read %d bytes, %v; want EOF", n, err)
		}
	}
	if n := srv.inflight.watcher.lot.parked(); n != 0 {
		t.Errorf("%d connections still parked after Shutdown", n)
	}
}

// A request pipelined behind a stream whose body the router reads from the
// connection (over smallBody, within the 16 KiB read that brought its head; sent in the same write) is read ahead with
// that body, and is served after the stream rather than left waiting for
// bytes that have already arrived.
func TestStreamThenPipelinedRequest(t *testing.T) {
	base, _, _, _ := h2cPD(t, mockworker.Config{}, mockworker.Config{})
	c, err := net.Dial("tcp", strings.TrimPrefix(base, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	stream := `{"text":"a b c` + strings.Repeat(" d", 5<<10) + `","stream":true,"sampling_params":{"max_new_tokens":3}}`
	plain := `{"text":"a b c","sampling_params":{"max_new_tokens":3}}`
	fmt.Fprintf(c, "POST /generate HTTP/1.1\r\nHost: r\r\nContent-Length: %d\r\n\r\n%sPOST /generate HTTP/1.1\r\nHost: r\r\nContent-Length: %d\r\n\r\n%s",
		len(stream), stream, len(plain), plain)
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	br := bufio.NewReader(c)
	for i, want := range []string{"data: [DONE]", `"text"`} {
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatalf("response %d: %v", i, err)
		}
		b, err := io.ReadAll(resp.Body)
		if err != nil || resp.StatusCode != 200 || !strings.Contains(string(b), want) {
			t.Fatalf("response %d: status %d, err %v: %q", i, resp.StatusCode, err, b)
		}
	}
}
