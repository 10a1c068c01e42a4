package kvtransfer

import (
	"bytes"
	"errors"
	"io"
	"net"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/pdrouter/pdrouter/kvtransfer/wire"
)

// writeOnlyClient is an engine's direct connection to m's peer port,
// opened with MEM_CLIENT; it returns the table the handshake answered.
func writeOnlyClient(t *testing.T, m *memSide) (*wire.Conn, *wire.MemRegions) {
	t.Helper()
	nc, err := net.Dial("tcp", m.p.PeerAddr())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { nc.Close() })
	_ = nc.SetDeadline(time.Now().Add(5 * time.Second))
	c := wire.NewConn(nc)
	if err := c.Write(&wire.MemClient{Name: "engine"}); err != nil {
		t.Fatal(err)
	}
	msg, err := c.Read()
	if err != nil {
		t.Fatalf("MEM_CLIENT answered with %v", err)
	}
	tab, ok := msg.(*wire.MemRegions)
	if !ok || tab.Seq != 0 {
		t.Fatalf("MEM_CLIENT answered with %+v", msg)
	}
	return c, tab
}

// regionAt is the table's region based at base.
func regionAt(t *testing.T, tab []wire.MemRegion, base uint64) wire.MemRegion {
	t.Helper()
	for _, r := range tab {
		if r.Base == base {
			return r
		}
	}
	t.Fatalf("no region at %#x in %+v", base, tab)
	return wire.MemRegion{}
}

// fencedWrite sends pieces and a fence seq and returns the fence's answer.
func fencedWrite(t *testing.T, c *wire.Conn, seq uint64, pieces ...wire.DataPiece) *wire.MemFenceAck {
	t.Helper()
	if err := c.WriteDataThen(pieces, &wire.MemFence{Seq: seq}); err != nil {
		t.Fatal(err)
	}
	msg, err := c.Read()
	if err != nil {
		t.Fatal(err)
	}
	ack, ok := msg.(*wire.MemFenceAck)
	if !ok || ack.Seq != seq {
		t.Fatalf("fence %d answered with %+v", seq, msg)
	}
	return ack
}

// A write-only client lands bytes and has each fence answered once they are
// in the engine's memory, a destination gone or out of bounds is named in
// the answer (and the connection carries on), and it never becomes a link:
// the link between the two kvproxies, its table and its writes go on as
// before, and the status counts the client apart.
func TestWriteOnlyClient(t *testing.T) {
	a, b, src, dst := newMemPair(t, "tcp", 2*time.Second, 2*page, 3)
	ctx := t.Context()
	if err := a.s.Write(ctx, b.p.PeerAddr(), []Triple{{Src: addrOf(src), Dst: addrOf(dst), Len: 64}}); err != nil {
		t.Fatal(err)
	}
	c, tab := writeOnlyClient(t, b)
	if a.p.Links() != 1 || b.p.Links() != 1 {
		t.Fatalf("links %d and %d with a write-only client connected, want 1 and 1", a.p.Links(), b.p.Links())
	}
	r := regionAt(t, tab.Regions, addrOf(dst))
	data := bytes.Repeat([]byte{0xd1}, 100)
	if ack := fencedWrite(t, c, 1, wire.DataPiece{Region: r.ID, Offset: page + 10, Data: data}); ack.Err != "" {
		t.Fatal(ack.Err)
	}
	if !bytes.Equal(dst[page+10:page+110], data) {
		t.Fatal("the client's bytes are not in the engine's memory when the fence is answered")
	}
	// Past the region's end: dropped and named; the next write still lands.
	if ack := fencedWrite(t, c, 2, wire.DataPiece{Region: r.ID, Offset: 2*page - 10, Data: data}); !strings.Contains(ack.Err, "not registered") {
		t.Fatalf("out of bounds: answer %q", ack.Err)
	}
	if ack := fencedWrite(t, c, 3, wire.DataPiece{Region: r.ID, Offset: 0, Data: data[:5]}); ack.Err != "" || !bytes.Equal(dst[:5], data[:5]) {
		t.Fatalf("after a dropped write: %q", ack.Err)
	}
	// A region registered later is found by asking; once gone it is named.
	late, dup := engineMemory(t, page)
	b.register(t, late, dup)
	if err := c.Write(&wire.MemRegionsReq{Seq: 4}); err != nil {
		t.Fatal(err)
	}
	msg, err := c.Read()
	if err != nil {
		t.Fatal(err)
	}
	again, ok := msg.(*wire.MemRegions)
	if !ok || again.Seq != 4 {
		t.Fatalf("MEM_REGIONS_REQ answered with %+v", msg)
	}
	lr := regionAt(t, again.Regions, addrOf(late))
	if err := b.s.Unregister(addrOf(late)); err != nil {
		t.Fatal(err)
	}
	if ack := fencedWrite(t, c, 5, wire.DataPiece{Region: lr.ID, Data: data}); !strings.Contains(ack.Err, "not registered") {
		t.Fatalf("unregistered region: answer %q", ack.Err)
	}
	// The kvproxies' own link is untouched: its writes land, no push went to the client.
	fill(src, 5)
	if err := a.s.Write(ctx, b.p.PeerAddr(), []Triple{{Src: addrOf(src), Dst: addrOf(dst), Len: page}}); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(dst[:page], src[:page]) || a.p.Links() != 1 || b.p.Links() != 1 {
		t.Fatalf("the link's write after the client's: landed %v, links %d and %d", bytes.Equal(dst[:page], src[:page]), a.p.Links(), b.p.Links())
	}
	st := b.p.Paths()
	if st.DirectClients != 1 || st.DirectWrites != 4 || len(st.Links) != 1 {
		t.Fatalf("status %+v, want 1 client, 4 writes, 1 link", st)
	}
	if got := b.metric(t, "kvproxy_direct_writes_total"); got != 4 {
		t.Fatalf("kvproxy_direct_writes_total %v, want 4", got)
	}
	c.Close()
	deadline := time.Now().Add(5 * time.Second)
	for b.p.Paths().DirectClients != 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if n := b.metric(t, "kvproxy_direct_clients"); n != 0 {
		t.Fatalf("%v clients after the only one hung up", n)
	}
}

// Anything but DATA, MEM_FENCE and MEM_REGIONS_REQ from a write-only client
// closes it: it cannot join rooms, answer fences, or turn into a link.
func TestWriteOnlyClientMalformed(t *testing.T) {
	b := newMemSide(t, "tcp", 2*time.Second)
	for _, m := range []wire.Msg{
		&wire.MemHello{Name: "late", Transport: "tcp"},
		&wire.XferReq{Room: 1},
		&wire.MemFenceAck{Seq: 1},
		&wire.MemRegions{},
		&wire.MemClient{Name: "twice"},
	} {
		c, _ := writeOnlyClient(t, b)
		if err := c.Write(m); err != nil {
			t.Fatal(err)
		}
		if msg, err := c.Read(); err == nil {
			t.Fatalf("%s: answered %s, want the connection closed", m.Type(), msg.Type())
		}
		if b.p.Links() != 0 {
			t.Fatalf("%s: a write-only client became a link", m.Type())
		}
	}
}

// A client that stops midway through a DATA frame is dropped within the
// write timeout, as a link would be.
func TestWriteOnlyClientStalledMidFrame(t *testing.T) {
	b := newMemSide(t, "tcp", 300*time.Millisecond)
	dst := b.memory(t, page)
	c, tab := writeOnlyClient(t, b)
	f := wire.AppendFrame(nil, &wire.Data{Region: regionAt(t, tab.Regions, addrOf(dst)).ID, N: 1000})
	if _, err := c.NetConn().Write(append(f, make([]byte, 10)...)); err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	_ = c.NetConn().SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.NetConn().Read(make([]byte, 1)); !errors.Is(err, io.EOF) {
		t.Fatalf("read %v, want the peer to close", err)
	}
	if d := time.Since(t0); d > 2*time.Second {
		t.Fatalf("closed after %v, write timeout 300ms", d)
	}
}

// Clients coming and going leave no goroutine or descriptor behind.
func TestWriteOnlyClientsLeakNothing(t *testing.T) {
	b := newMemSide(t, "tcp", 2*time.Second)
	dst := b.memory(t, page)
	fds := func() int {
		ents, err := os.ReadDir("/proc/self/fd")
		if err != nil {
			t.Skip("no /proc/self/fd")
		}
		return len(ents)
	}
	g0, f0 := runtime.NumGoroutine(), fds()
	for i := range 20 {
		nc, err := net.Dial("tcp", b.p.PeerAddr())
		if err != nil {
			t.Fatal(err)
		}
		c := wire.NewConn(nc)
		if err := c.Write(&wire.MemClient{Name: "e"}); err != nil {
			t.Fatal(err)
		}
		msg, err := c.Read()
		if err != nil {
			t.Fatal(err)
		}
		id := regionAt(t, msg.(*wire.MemRegions).Regions, addrOf(dst)).ID
		if i%2 == 0 { // half hang up with a fence unanswered
			if ack := fencedWrite(t, c, 1, wire.DataPiece{Region: id, Data: []byte{byte(i)}}); ack.Err != "" {
				t.Fatal(ack.Err)
			}
		} else if err := c.WriteDataThen([]wire.DataPiece{{Region: id, Data: []byte{1}}}, &wire.MemFence{Seq: 1}); err != nil {
			t.Fatal(err)
		}
		nc.Close()
	}
	deadline := time.Now().Add(5 * time.Second)
	for (runtime.NumGoroutine() > g0 || fds() > f0 || b.p.Paths().DirectClients != 0) && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if g, f := runtime.NumGoroutine(), fds(); g > g0 || f > f0 {
		t.Fatalf("after 20 clients: %d goroutines (%d before), %d fds (%d before)", g, g0, f, f0)
	}
	if st := b.p.Paths(); st.DirectClients != 0 || st.DirectWrites != 20 {
		t.Fatalf("status %+v, want no client and 20 writes", st)
	}
}

// DirectRoute sends an engine's small writes direct only where host memory
// moves as DATA frames over tcp, and says so in the link's status.
func TestDirectRoute(t *testing.T) {
	a, b := newMemSide(t, "tcp", 2*time.Second), newMemSide(t, "tcp", 2*time.Second)
	ok, why, timeout, err := a.s.DirectRoute(t.Context(), b.p.PeerAddr())
	if err != nil || !ok || why != "" || timeout != 2*time.Second {
		t.Fatalf("tcp: %v %q %v %v, want direct within 2s", ok, why, timeout, err)
	}
	if st := a.p.Paths(); len(st.Links) != 1 || st.Links[0].DirectRoutes != 1 {
		t.Fatalf("status %+v, want one link with one direct route", st)
	}
	s, u := newMemSide(t, "shm", 2*time.Second), newMemSide(t, "shm", 2*time.Second)
	if ok, why, _, err := s.s.DirectRoute(t.Context(), u.p.PeerAddr()); err != nil || ok || !strings.Contains(why, "shm") {
		t.Fatalf("shm: %v %q %v, want not direct, saying shm", ok, why, err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gone := ln.Addr().String()
	ln.Close()
	if ok, _, _, err := a.s.DirectRoute(t.Context(), gone); err == nil || ok {
		t.Fatalf("unreachable peer: %v %v, want an error", ok, err)
	}
}
