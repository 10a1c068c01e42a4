package kvtransfer

import (
	"errors"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/pdrouter/pdrouter/kvtransfer/wire"
)

// Before its MEM_HELLO a connection to the peer port may send one frame,
// a MEM_HELLO of at most maxHelloLen, within the handshake deadline: a
// longer one, another frame, a silent connection and one that trickles are
// all closed, and a good peer still links.
func TestPeerPortBeforeHello(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p, err := NewMemoryPlane(MemoryConfig{Name: "p", Transport: &TCP{}, Listener: ln, WriteTimeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
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
	// A header announcing more than the limit is closed at once, not at the
	// deadline, as is a first frame of another type.
	big := wire.AppendFrame(nil, &wire.MemHello{Name: "x", WorkerAddr: make([]byte, 256<<10)})
	c := dial()
	_, _ = c.Write(big[:wire.HeaderLen])
	closedWithin("oversized MEM_HELLO", c, time.Second)
	c = dial()
	_, _ = c.Write(wire.AppendFrame(nil, &wire.MemClient{Name: strings.Repeat("x", 256<<10)})[:wire.HeaderLen])
	closedWithin("oversized MEM_CLIENT", c, time.Second)
	c = dial()
	_, _ = c.Write(wire.AppendFrame(nil, &wire.XferReq{Room: 1}))
	closedWithin("XFER_REQ before MEM_HELLO", c, time.Second)
	// Silent, and a header then nothing: closed at the handshake deadline.
	silent := dial()
	partial := dial()
	hello := wire.AppendFrame(nil, &wire.MemHello{Name: "r", Transport: "tcp"})
	_, _ = partial.Write(hello[:len(hello)-1])
	closedWithin("silent", silent, 4*time.Second)
	closedWithin("partial MEM_HELLO", partial, 4*time.Second)
	// A good peer still links.
	q := newMemSide(t, "tcp", 2*time.Second)
	if err := q.s.Probe(t.Context(), ln.Addr().String()); err != nil {
		t.Fatal(err)
	}
}
