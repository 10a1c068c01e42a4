package kvtransfer

import (
	"bytes"
	"errors"
	"io"
	"net"
	"testing"
	"time"

	"github.com/pdrouter/pdrouter/kvtransfer/wire"
)

func TestSplitPeerListener(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	rooms, memory := SplitPeerListener(ln)
	if rooms.Addr().String() != ln.Addr().String() || memory.Addr().String() != ln.Addr().String() {
		t.Fatal("sub-listeners do not report the port's address")
	}
	send := func(m wire.Msg) []byte {
		c, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		f := wire.AppendFrame(nil, m)
		if _, err := c.Write(f); err != nil {
			t.Fatal(err)
		}
		return f
	}
	expectOn := func(l net.Listener, frame []byte) {
		t.Helper()
		c, err := l.Accept()
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		got := make([]byte, len(frame))
		if _, err := io.ReadFull(c, got); err != nil || !bytes.Equal(got, frame) {
			t.Fatalf("frame through the split: %v %x, want %x", err, got, frame)
		}
	}
	expectOn(memory, send(&wire.MemHello{Name: "m"}))
	expectOn(rooms, send(&wire.Hello{Name: "r"}))
	// Anything else is closed unread.
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_, _ = c.Write([]byte("GET / HTTP/1.1\r\n\r\n"))
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	var ne net.Error
	if _, err := c.Read(make([]byte, 1)); err == nil || (errors.As(err, &ne) && ne.Timeout()) {
		t.Fatalf("a stranger's connection: %v, want it closed", err)
	}
	// A closed side refuses its connections; the port stays for the other.
	if err := rooms.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := rooms.Accept(); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("accept on a closed side: %v", err)
	}
	expectOn(memory, send(&wire.MemHello{Name: "again"}))
	// A connection still silent when the port closes goes with it.
	silent, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer silent.Close()
	time.Sleep(20 * time.Millisecond)
	if err := memory.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := net.Dial("tcp", ln.Addr().String()); err == nil {
		t.Fatal("the port still accepts after both sides closed")
	}
}

// Before its HELLO a connection may send one frame of at most maxHelloLen
// within the hello timeout: a longer frame, a silent connection and one
// that trickles are all closed, and a flood holds no more than the bytes
// it sent.
func TestPeerPortBeforeHello(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	rooms, memory := splitPeerListener(ln, 300*time.Millisecond)
	defer rooms.Close()
	defer memory.Close()
	dial := func() net.Conn {
		c, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	closedWithin := func(what string, c net.Conn, d time.Duration) {
		t.Helper()
		_ = c.SetReadDeadline(time.Now().Add(d))
		var ne net.Error
		if _, err := c.Read(make([]byte, 1)); err == nil || (errors.As(err, &ne) && ne.Timeout()) {
			t.Fatalf("%s: %v, want the port to close it", what, err)
		}
	}
	// A HELLO header announcing more than the limit is closed at once.
	big := wire.AppendFrame(nil, &wire.Hello{Name: "x", WorkerAddr: make([]byte, maxHelloLen)})
	c := dial()
	_, _ = c.Write(big[:wire.HeaderLen])
	closedWithin("oversized HELLO", c, time.Second)
	// Silent, and a header then nothing: closed at the hello deadline.
	silent := dial()
	partial := dial()
	hello := wire.AppendFrame(nil, &wire.Hello{Name: "r"})
	_, _ = partial.Write(hello[:len(hello)-1])
	closedWithin("silent", silent, 3*time.Second)
	closedWithin("partial HELLO", partial, 3*time.Second)
	// A good HELLO still gets through.
	_, _ = dial().Write(hello)
	got, err := rooms.Accept()
	if err != nil {
		t.Fatal(err)
	}
	got.Close()
}
