package kvtransfer

import (
	"context"
	"errors"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pdrouter/pdrouter/kvtransfer/wire"
	"github.com/pdrouter/pdrouter/testkit/kvtest"
)

// started is a Start's done: the result, whether it ran before Start
// returned, and whether the link's reader ran it.
type started struct {
	err              error
	inline, onReader bool
}

func startWrite(s *MemorySession, peer string, ts []Triple) (chan started, bool) {
	ch := make(chan started, 1)
	var back atomic.Bool
	ok := s.Start(peer, ts, func(err error) {
		buf := make([]byte, 8<<10)
		ch <- started{err, !back.Load(), strings.Contains(string(buf[:runtime.Stack(buf, false)]), "(*memLink).readLoop")}
	})
	back.Store(true)
	return ch, ok
}

// TestStart: only a small host-to-host write, on a link that is up, into
// memory the link's table lists, is started; over shm it is done when
// Start returns, over tcp the link's reader finishes it.
func TestStart(t *testing.T) {
	a, b := newMemSide(t, "shm", 5*time.Second), newMemSide(t, "shm", 5*time.Second)
	src, srcFd := engineMemory(t, 32*page)
	a.register(t, src, srcFd)
	dst, dstFd := engineMemory(t, 32*page)
	b.register(t, dst, dstFd)
	peer := b.p.PeerAddr()
	small := []Triple{{Src: addrOf(src), Dst: addrOf(dst), Len: 64}}
	if _, ok := startWrite(a.s, peer, small); ok {
		t.Fatal("started before the link is up (a dial waits on the peer)")
	}
	if err := a.s.Write(context.Background(), peer, small); err != nil {
		t.Fatal(err)
	}
	src[0] = 7
	ch, ok := startWrite(a.s, peer, small)
	if !ok {
		t.Fatal("a 64-byte shm write on a link that is up is not started")
	}
	if r := <-ch; r.err != nil || !r.inline || dst[0] != 7 {
		t.Fatalf("shm write: %v, done when Start returned: %t, byte %d", r.err, r.inline, dst[0])
	}
	late, lateFd := engineMemory(t, page)
	b.register(t, late, lateFd)
	many := make([]Triple, startTriples+1)
	for i := range many {
		many[i] = Triple{Src: addrOf(src) + uint64(i), Dst: addrOf(dst) + uint64(i), Len: 1}
	}
	for name, ts := range map[string][]Triple{
		"over startMax":                 {{Src: addrOf(src), Dst: addrOf(dst), Len: startMax + 1}},
		"over startMax, summed":         {{Src: addrOf(src), Dst: addrOf(dst), Len: startMax}, {Src: addrOf(src), Dst: addrOf(dst) + startMax, Len: 1}},
		"too many ranges":               many,
		"a destination the table lacks": {{Src: addrOf(src), Dst: addrOf(late), Len: 64}},
		"an unregistered source":        {{Src: 1 << 20, Dst: addrOf(dst), Len: 64}},
		"no ranges":                     nil,
	} {
		if _, ok := startWrite(a.s, peer, ts); ok {
			t.Errorf("%s: started", name)
		}
	}
	if _, ok := startWrite(a.s, "127.0.0.1:1", small); ok {
		t.Error("started to a peer with no link")
	}

	c, d := newMemSide(t, "tcp", 5*time.Second), newMemSide(t, "tcp", 5*time.Second)
	c.register(t, src, srcFd)
	d.register(t, dst, dstFd)
	if err := c.s.Write(context.Background(), d.p.PeerAddr(), small); err != nil {
		t.Fatal(err)
	}
	src[0] = 8
	ch, ok = startWrite(c.s, d.p.PeerAddr(), small)
	if !ok {
		t.Fatal("a 64-byte tcp write on a link that is up is not started")
	}
	if r := <-ch; r.err != nil || dst[0] != 8 || !r.onReader {
		t.Fatalf("tcp write: %v, byte %d, finished by the link's reader: %t", r.err, dst[0], r.onReader)
	}
}

// TestStartedTCPWriteHasNoGoroutineBetween pins issue 28's small-write
// path: the caller of Start sends the write's segment itself (it is on
// the wire when Start returns: no writer goroutine to wake) and the link's
// reader completes it (no channel hop to a waiting goroutine).
func TestStartedTCPWriteHasNoGoroutineBetween(t *testing.T) {
	a, b := newMemSide(t, "tcp", 5*time.Second), newMemSide(t, "tcp", 5*time.Second)
	src := a.memory(t, page)
	dst := b.memory(t, page)
	peer := b.p.PeerAddr()
	ts := []Triple{{Src: addrOf(src), Dst: addrOf(dst) + 128, Len: 64}}
	if err := a.s.Write(context.Background(), peer, ts); err != nil {
		t.Fatal(err)
	}
	a.p.mu.Lock()
	l := a.p.byAddr[peer]
	a.p.mu.Unlock()
	for i := range 20 {
		src[0] = byte(i + 1)
		before := dataSegsOut(t, l.conn.NetConn())
		ch, ok := startWrite(a.s, peer, ts)
		if !ok {
			t.Fatalf("write %d not started", i)
		}
		if sent := dataSegsOut(t, l.conn.NetConn()) - before; sent < 1 {
			t.Fatalf("write %d: nothing on the wire when Start returned", i)
		}
		if r := <-ch; r.err != nil || !r.onReader || dst[128] != byte(i+1) {
			t.Fatalf("write %d: %v, finished by the link's reader: %t, byte %d", i, r.err, r.onReader, dst[128])
		}
	}
}

// TestStartedWriteTimesOut: a started write the peer never answers fails
// once its own deadline passed (the link's one watchdog re-arms for it
// after an earlier write's answer), not sooner, and takes the link down.
func TestStartedWriteTimesOut(t *testing.T) {
	const timeout = 400 * time.Millisecond
	a := newMemSide(t, "tcp", timeout)
	src := a.memory(t, page)
	hello := &wire.MemHello{Transport: "tcp", Regions: []wire.MemRegion{{ID: 1, Base: 1 << 30, Len: 1 << 20}}}
	peer, stop := kvtest.Peer(t, hello, func(c *wire.Conn, quit <-chan struct{}) {
		for answered := false; ; { // the first fence only
			m, err := c.Read()
			if err != nil {
				return
			}
			if _, ok := m.(*wire.Data); ok {
				_ = c.DiscardData()
			}
			if f, ok := m.(*wire.MemFence); ok && !answered {
				answered = true
				c.Post(&wire.MemFenceAck{Seq: f.Seq})
			}
		}
	})
	defer stop()
	if _, err := a.p.link(context.Background(), peer); err != nil {
		t.Fatal(err)
	}
	ts := []Triple{{Src: addrOf(src), Dst: 1 << 30, Len: 64}}
	first, ok := startWrite(a.s, peer, ts)
	if !ok {
		t.Fatal("not started")
	}
	if r := <-first; r.err != nil {
		t.Fatal(r.err)
	}
	time.Sleep(timeout / 2)
	t0 := time.Now()
	second, ok := startWrite(a.s, peer, ts)
	if !ok {
		t.Fatal("not started")
	}
	r := <-second
	if took := time.Since(t0); r.err == nil || !errors.Is(r.err, context.DeadlineExceeded) || took < timeout || took > 3*timeout {
		t.Fatalf("unanswered write: %v after %s (timeout %s)", r.err, took, timeout)
	}
	if a.p.Links() != 0 {
		t.Fatal("the link outlived an unanswered write")
	}
}
