package control

import (
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"path/filepath"
	"runtime"
	"testing"
	"time"
)

// bareServer serves a control socket with neither API (frames are read and
// answered with errors), configured by tune.
func bareServer(t *testing.T, tune func(*Server)) string {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "kvproxy.sock")
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	srv := &Server{}
	tune(srv)
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ctx, ln) }()
	t.Cleanup(func() {
		cancel()
		if err := <-served; err != nil {
			t.Error(err)
		}
	})
	return sock
}

func dialRaw(t *testing.T, sock string) *net.UnixConn {
	t.Helper()
	c, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// closedByServer reports whether the server closed c within d.
func closedByServer(c net.Conn, d time.Duration) bool {
	_ = c.SetReadDeadline(time.Now().Add(d))
	_, err := c.Read(make([]byte, 1))
	return errors.Is(err, io.EOF) || errors.Is(err, net.ErrClosed) || isReset(err)
}

func isReset(err error) bool {
	var ne *net.OpError
	return errors.As(err, &ne) && !ne.Timeout()
}

// A frame's declared length is not allocated on trust: ten connections
// each declaring the biggest frame and sending 1 MiB of it cost about what
// they sent, not 10 × 16 MiB; the server drops each once its frame stalls
// past FrameTimeout, and the memory goes back.
func TestTruncatedFramesCostWhatTheySent(t *testing.T) {
	sock := bareServer(t, func(s *Server) { s.FrameTimeout = 300 * time.Millisecond })
	const conns, sent = 10, 1 << 20
	head := binary.LittleEndian.AppendUint32(nil, maxFrame)
	body := make([]byte, sent)
	heap := func() uint64 {
		runtime.GC()
		var m runtime.MemStats
		runtime.ReadMemStats(&m)
		return m.HeapAlloc
	}
	before := heap()
	var cs []*net.UnixConn
	for range conns {
		c := dialRaw(t, sock)
		// The body's write returns once the server has read most of it (the
		// socket buffer is far smaller), so the server has seen the header.
		if _, err := c.Write(head); err != nil {
			t.Fatal(err)
		}
		if _, err := c.Write(body); err != nil {
			t.Fatal(err)
		}
		cs = append(cs, c)
	}
	if held := int64(heap()) - int64(before); held > 4*conns*sent {
		t.Errorf("%d connections that sent %d bytes each hold %d MiB", conns, sent, held>>20)
	}
	for i, c := range cs {
		if !closedByServer(c, 10*time.Second) {
			t.Fatalf("connection %d: a frame stalled midway was not dropped", i)
		}
	}
	// Dropped, they give their memory back.
	deadline := time.Now().Add(10 * time.Second)
	for heap() > before+4*sent {
		if time.Now().After(deadline) {
			t.Fatalf("%d MiB still held after the connections were dropped", (heap()-before)>>20)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// An idle connection (no frame begun) is not timed out: engines keep theirs
// open between requests.
func TestIdleConnectionOutlivesFrameTimeout(t *testing.T) {
	sock := bareServer(t, func(s *Server) { s.FrameTimeout = 50 * time.Millisecond })
	c := dialRaw(t, sock)
	if closedByServer(c, 300*time.Millisecond) {
		t.Fatal("an idle connection was closed")
	}
	cl, err := Dial(sock)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	time.Sleep(100 * time.Millisecond)
	if _, _, err := cl.Hello(context.Background()); err == nil || errors.Is(err, ErrClientClosed) {
		t.Fatalf("hello after idling: %v, want the server's answer (no memory API)", err)
	}
}

// Connections past MaxConns are closed at once; one freed makes room.
func TestConnectionCap(t *testing.T) {
	sock := bareServer(t, func(s *Server) { s.MaxConns = 2 })
	a := dialRaw(t, sock)
	dialRaw(t, sock)
	if closedByServer(a, 200*time.Millisecond) {
		t.Fatal("a connection under the cap was closed")
	}
	over := dialRaw(t, sock)
	if !closedByServer(over, 10*time.Second) {
		t.Fatal("a connection over the cap was kept")
	}
	a.Close()
	// The freed slot takes a new client, which the server answers.
	deadline := time.Now().Add(10 * time.Second)
	for {
		cl, err := Dial(sock)
		if err != nil {
			t.Fatal(err)
		}
		_, _, err = cl.Hello(context.Background())
		cl.Close()
		if err != nil && !errors.Is(err, ErrClientClosed) {
			break // answered (no memory API): served
		}
		if time.Now().After(deadline) {
			t.Fatal("a slot freed by a closed connection was never reused")
		}
		time.Sleep(10 * time.Millisecond)
	}
}
