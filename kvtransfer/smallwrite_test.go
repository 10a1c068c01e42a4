package kvtransfer

import (
	"context"
	"net"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// dataSegsOut is how many segments carrying data the socket beneath c has
// sent (TCP_INFO), the kernel's count of its sends that reached the wire.
func dataSegsOut(t *testing.T, c net.Conn) uint32 {
	t.Helper()
	sc, ok := c.(syscall.Conn)
	if !ok {
		t.Fatalf("%T has no socket", c)
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var info *unix.TCPInfo
	var serr error
	if err := rc.Control(func(fd uintptr) { info, serr = unix.GetsockoptTCPInfo(int(fd), unix.IPPROTO_TCP, unix.TCP_INFO) }); err != nil {
		t.Fatal(err)
	}
	if serr != nil {
		t.Fatal(serr)
	}
	return info.Data_segs_out
}

// TestSmallTCPWriteIsOneSegmentEachWay: a 64-byte write over the tcp path
// costs one round trip of one segment each way (its DATA frame and fence
// together, then the fence answer), not a segment per frame: each segment
// is a wake-up of the other kvproxy (issue 28).
func TestSmallTCPWriteIsOneSegmentEachWay(t *testing.T) {
	a, b := newMemSide(t, "tcp", 5*time.Second), newMemSide(t, "tcp", 5*time.Second)
	src, srcFd := engineMemory(t, page)
	fill(src, 3)
	a.register(t, src, srcFd)
	dst, dstFd := engineMemory(t, page)
	b.register(t, dst, dstFd)
	ts := []Triple{{Src: addrOf(src), Dst: addrOf(dst) + 128, Len: 64}}
	ctx := context.Background()
	if err := a.s.Write(ctx, b.p.PeerAddr(), ts); err != nil { // the link and tables up
		t.Fatal(err)
	}
	a.p.mu.Lock()
	la := a.p.byAddr[b.p.PeerAddr()]
	a.p.mu.Unlock()
	var lb *memLink
	deadline := time.Now().Add(5 * time.Second)
	for lb == nil && time.Now().Before(deadline) {
		b.p.mu.Lock()
		for l := range b.p.links {
			lb = l
		}
		b.p.mu.Unlock()
		time.Sleep(time.Millisecond)
	}
	if la == nil || lb == nil {
		t.Fatal("no link")
	}
	const writes = 20
	outA, outB := dataSegsOut(t, la.conn.NetConn()), dataSegsOut(t, lb.conn.NetConn())
	for i := range writes {
		src[0] = byte(i)
		if err := a.s.Write(ctx, b.p.PeerAddr(), ts); err != nil {
			t.Fatal(err)
		}
		if dst[128] != byte(i) {
			t.Fatalf("write %d did not land", i)
		}
	}
	if got := dataSegsOut(t, la.conn.NetConn()) - outA; got != writes {
		t.Errorf("writer sent %d data segments for %d small writes, want one each", got, writes)
	}
	if got := dataSegsOut(t, lb.conn.NetConn()) - outB; got != writes {
		t.Errorf("peer sent %d data segments for %d fences, want one each", got, writes)
	}
}
