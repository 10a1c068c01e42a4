package router

import (
	"errors"
	"net"
	"sync/atomic"
	"testing"
	"time"
)

func loopback(tb testing.TB) net.Listener {
	tb.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { ln.Close() })
	return ln
}

// Both ways of watching: the shared epoll set (Linux) and a goroutine per
// watch (elsewhere, or when epoll cannot be set up).
func watchers() map[string]func() *watcher {
	return map[string]func() *watcher{
		"shared":    func() *watcher { return &watcher{} },
		"goroutine": func() *watcher { return &watcher{epErr: errors.ErrUnsupported} },
	}
}

func TestConnWatcherSeesDisconnectAndNotPipelining(t *testing.T) {
	ln := loopback(t)
	for name, newWatcher := range watchers() {
		w := newWatcher()
		for _, c := range []struct {
			name     string
			act      func(net.Conn)
			wantGone bool
		}{
			{"close", func(c net.Conn) { c.Close() }, true},
			{"reset", func(c net.Conn) { c.(*net.TCPConn).SetLinger(0); c.Close() }, true},
			{"pipelined bytes", func(c net.Conn) { c.Write([]byte("GET / HTTP/1.1\r\n")) }, false},
		} {
			client, server := tcpPair(t, ln)
			// A read deadline left from reading the request must not end the watch.
			server.SetReadDeadline(time.Now().Add(time.Millisecond))
			gone := make(chan struct{}, 1)
			var cw connWatch
			if !w.start(&cw, server, func() { gone <- struct{}{} }) {
				t.Fatalf("%s/%s: not watched", name, c.name)
			}
			time.Sleep(5 * time.Millisecond) // parked
			c.act(client)
			select {
			case <-gone:
				if !c.wantGone {
					t.Errorf("%s/%s: reported gone", name, c.name)
				}
			case <-time.After(300 * time.Millisecond):
				if c.wantGone {
					t.Errorf("%s/%s: not reported", name, c.name)
				}
			}
			cw.stop()
			// The connection is usable again: no deadline of the watch's is left.
			if !c.wantGone {
				server.SetReadDeadline(time.Now().Add(time.Second))
				buf := make([]byte, 3)
				if _, err := server.Read(buf); err != nil || string(buf) != "GET" {
					t.Errorf("%s/%s: read after stop: %q %v", name, c.name, buf, err)
				}
			}
			client.Close()
			server.Close()
		}
		w.close()
	}
}

// A stopped watch never reports, and of many watches only the departed
// clients' report; a connection can be watched again after a stop (the
// next keep-alive request).
func TestConnWatcherStopAndManyWatches(t *testing.T) {
	ln := loopback(t)
	for name, newWatcher := range watchers() {
		w := newWatcher()
		const n = 20
		var fired [n]atomic.Int32
		clients, servers := make([]net.Conn, n), make([]net.Conn, n)
		watches := make([]connWatch, n)
		for i := range n {
			clients[i], servers[i] = tcpPair(t, ln)
			if !w.start(&watches[i], servers[i], func() { fired[i].Add(1) }) {
				t.Fatalf("%s: not watched", name)
			}
		}
		// Stop and rewatch the first half once: only the new watch may fire.
		for i := range n / 2 {
			watches[i].stop()
			if !w.start(&watches[i], servers[i], func() { fired[i].Add(10) }) {
				t.Fatalf("%s: not watched again", name)
			}
		}
		// Even clients leave; of the odd ones, the watch is stopped first.
		for i := range n {
			if i%2 == 1 {
				watches[i].stop()
			}
			if i%4 < 2 {
				clients[i].Close()
			}
		}
		waitFor(t, func() bool {
			for i := 0; i < n; i += 4 {
				if fired[i].Load() == 0 {
					return false
				}
			}
			return true
		})
		time.Sleep(20 * time.Millisecond)
		for i := range n {
			want := int32(0)
			if i%4 == 0 {
				want = 1
				if i < n/2 {
					want = 10
				}
			}
			if got := fired[i].Load(); got != want {
				t.Errorf("%s: conn %d reported %d, want %d", name, i, got, want)
			}
		}
		for i := range n {
			if i%2 == 0 {
				watches[i].stop()
			}
			clients[i].Close()
			servers[i].Close()
		}
		w.close()
	}
}

// Not a socket: nothing to watch. A closed watcher starts none.
func TestConnWatcherRefuses(t *testing.T) {
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	w := &watcher{}
	var cw connWatch
	if w.start(&cw, a, func() {}) {
		t.Fatal("watched a pipe")
	}
	w.close()
	if w.epoller() != nil {
		t.Fatal("closed watcher has an epoll set")
	}
}

// BenchmarkConnWatch is one watch started and stopped on an idle
// connection: what a request longer than watchDelay pays.
func BenchmarkConnWatch(b *testing.B) {
	client, server := tcpPair(b, loopback(b))
	defer client.Close()
	defer server.Close()
	for name, newWatcher := range watchers() {
		b.Run(name, func(b *testing.B) {
			w := newWatcher()
			defer w.close()
			var cw connWatch
			b.ReportAllocs()
			for b.Loop() {
				w.start(&cw, server, func() {})
				cw.stop()
			}
		})
	}
}
