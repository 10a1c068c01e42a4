package kvtransfer

import (
	"net"
	"testing"
	"time"

	"github.com/pdrouter/pdrouter/kvtransfer/wire"
)

// TestRoomMessagesWithoutARoomHandler: a plane with no room layer ignores
// a peer's heartbeats and closes a link that sends it a room message, and
// a handler set later gets them.
func TestRoomMessagesWithoutARoomHandler(t *testing.T) {
	m := newMemSide(t, "tcp", 2*time.Second)
	hello := func() *wire.Conn {
		nc, err := net.Dial("tcp", m.p.PeerAddr())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { nc.Close() })
		c := wire.NewConn(nc)
		if err := c.Write(&wire.MemHello{Name: "peer", Transport: "tcp", ListenAddr: "peer:1"}); err != nil {
			t.Fatal(err)
		}
		if _, err := c.Read(); err != nil {
			t.Fatal(err)
		}
		return c
	}
	links := func(want int) {
		t.Helper()
		for deadline := time.Now().Add(2 * time.Second); m.p.Links() != want; time.Sleep(5 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("%d links, want %d", m.p.Links(), want)
			}
		}
	}
	c := hello()
	if err := c.Write(&wire.Heartbeat{Seq: 1}); err != nil {
		t.Fatal(err)
	}
	links(1)
	if err := c.Write(&wire.Abort{Room: 1, Reason: "x"}); err != nil {
		t.Fatal(err)
	}
	links(0)

	h := &recordingHandler{got: make(chan wire.Msg, 1)}
	if err := m.p.SetRoomHandler(h); err != nil {
		t.Fatal(err)
	}
	if err := m.p.SetRoomHandler(&recordingHandler{}); err == nil {
		t.Fatal("a second room handler on one plane")
	}
	c = hello()
	if err := c.Write(&wire.Abort{Room: 2, Reason: "y"}); err != nil {
		t.Fatal(err)
	}
	select {
	case got := <-h.got:
		if a, ok := got.(*wire.Abort); !ok || a.Room != 2 {
			t.Fatalf("handler got %+v", got)
		}
	case <-time.After(2 * time.Second):
		t.Fatal("the handler got nothing")
	}
	links(1)
	m.p.ClearRoomHandler(h)
	if err := m.p.SetRoomHandler(h); err != nil {
		t.Fatalf("after ClearRoomHandler: %v", err)
	}
	m.p.ClearRoomHandler(h)
}

type recordingHandler struct{ got chan wire.Msg }

func (h *recordingHandler) RoomMsg(_ Link, m wire.Msg) error { h.got <- m; return nil }
func (h *recordingHandler) LinkLost(Link, error)             {}
