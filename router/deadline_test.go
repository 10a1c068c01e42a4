package router

import (
	"bufio"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/valyala/fasthttp"
)

// pipe is a lazyDeadlineConn over one end of a net.Pipe, and the other end.
func pipe(t *testing.T) (*lazyDeadlineConn, net.Conn) {
	a, b := net.Pipe()
	t.Cleanup(func() { a.Close(); b.Close() })
	return &lazyDeadlineConn{Conn: a}, b
}

func TestLazyDeadlineKeepsTheLaterDeadline(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		c, peer := pipe(t)
		start := time.Now()
		c.SetReadDeadline(start.Add(time.Second))     // armed on the socket
		c.SetReadDeadline(start.Add(3 * time.Second)) // kept; the socket's fires at 1 s
		go func() {
			time.Sleep(2 * time.Second)
			peer.Write([]byte("x"))
		}()
		var b [1]byte
		if n, err := c.Read(b[:]); n != 1 || err != nil {
			t.Fatalf("read %d %v, want the byte sent at 2 s (deadline 3 s)", n, err)
		}
		// Nothing more comes: the read ends at the deadline asked for, 3 s.
		if _, err := c.Read(b[:]); !errors.Is(err, os.ErrDeadlineExceeded) || time.Since(start) != 3*time.Second {
			t.Fatalf("read ended after %v with %v, want a timeout at 3s", time.Since(start), err)
		}
	})
}

func TestLazyDeadlineArmsAnEarlierDeadlineAtOnce(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		c, _ := pipe(t)
		start := time.Now()
		c.SetReadDeadline(start.Add(time.Hour))
		c.SetReadDeadline(start.Add(time.Second))
		var b [1]byte
		if _, err := c.Read(b[:]); !errors.Is(err, os.ErrDeadlineExceeded) || time.Since(start) != time.Second {
			t.Fatalf("read ended after %v with %v, want a timeout at 1s", time.Since(start), err)
		}
	})
}

func TestLazyDeadlineClearedWaitsForever(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		c, peer := pipe(t)
		c.SetReadDeadline(time.Now().Add(time.Second))
		c.SetReadDeadline(time.Time{})
		go func() {
			time.Sleep(time.Minute)
			peer.Write([]byte("x"))
		}()
		var b [1]byte
		if n, err := c.Read(b[:]); n != 1 || err != nil {
			t.Fatalf("read %d %v with no deadline, want the byte sent at 1 min", n, err)
		}
	})
}

func TestLazyDeadlineWriteGoesOnPastAnEarlierArm(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		c, peer := pipe(t)
		start := time.Now()
		c.SetWriteDeadline(start.Add(time.Second))
		c.SetWriteDeadline(start.Add(3 * time.Second))
		got := make(chan int)
		go func() {
			time.Sleep(2 * time.Second)
			var b [8]byte
			n, _ := peer.Read(b[:])
			got <- n
		}()
		if n, err := c.Write([]byte("abcd")); n != 4 || err != nil {
			t.Fatalf("write %d %v, want 4 bytes read by the peer at 2 s (deadline 3 s)", n, err)
		}
		if n := <-got; n != 4 {
			t.Fatalf("peer read %d bytes", n)
		}
		if _, err := c.Write([]byte("e")); !errors.Is(err, os.ErrDeadlineExceeded) || time.Since(start) != 3*time.Second {
			t.Fatalf("write ended after %v with %v, want a timeout at 3s", time.Since(start), err)
		}
	})
}

// deadlineCountingListener counts the deadline moves the router makes on
// its connections' sockets.
type deadlineCountingListener struct {
	net.Listener
	moves atomic.Int64
}

func (l *deadlineCountingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return &deadlineCountingConn{Conn: c, moves: &l.moves}, nil
}

type deadlineCountingConn struct {
	net.Conn
	moves *atomic.Int64
}

func (c *deadlineCountingConn) SetDeadline(t time.Time) error {
	c.moves.Add(1)
	return c.Conn.SetDeadline(t)
}

func (c *deadlineCountingConn) SetReadDeadline(t time.Time) error {
	c.moves.Add(1)
	return c.Conn.SetReadDeadline(t)
}

func (c *deadlineCountingConn) SetWriteDeadline(t time.Time) error {
	c.moves.Add(1)
	return c.Conn.SetWriteDeadline(t)
}

// A keep-alive client connection in regular mode: fasthttp moves its read
// deadline three times and its write deadline once per request; the
// socket's timers move only for the first (the old code: 4 per request).
func TestRegularClientSocketDeadlinesMoveOncePerConnection(t *testing.T) {
	cfg := DefaultConfig()
	cfg.WorkerURLs = []string{cannedBackend(t, false)}
	var cl *deadlineCountingListener
	base, srv := serveInProcessThrough(t, cfg, prometheus.NewRegistry(), func(ln net.Listener) net.Listener {
		cl = &deadlineCountingListener{Listener: ln}
		return cl
	})
	defer shutdown(t, srv)

	conn, err := net.Dial("tcp", strings.TrimPrefix(base, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	br := bufio.NewReader(conn)
	var resp fasthttp.Response
	const requests = 50
	for range requests {
		body := `{"text":"hi"}`
		fmt.Fprintf(conn, "POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
		if err := resp.Read(br); err != nil || resp.StatusCode() != 200 {
			t.Fatalf("%d %v %s", resp.StatusCode(), err, resp.Body())
		}
	}
	if moves := cl.moves.Load(); moves > 4 {
		t.Fatalf("%d socket deadline moves for %d requests on one connection, want at most 4", moves, requests)
	}
}
