package kvtransfer

import (
	"context"
	"testing"
	"time"
)

// TestImmediate: only a small host-to-host write over shm, on a link that
// is up, into memory the link's table lists, may run in the control
// server's read loop; everything else may wait on the peer.
func TestImmediate(t *testing.T) {
	a, b := newMemSide(t, "shm", 5*time.Second), newMemSide(t, "shm", 5*time.Second)
	src, srcFd := engineMemory(t, 32*page)
	a.register(t, src, srcFd)
	dst, dstFd := engineMemory(t, 32*page)
	b.register(t, dst, dstFd)
	peer := b.p.PeerAddr()
	small := []Triple{{Src: addrOf(src), Dst: addrOf(dst), Len: 64}}
	if a.p.Immediate(peer, small) {
		t.Fatal("immediate before the link is up (a dial waits on the peer)")
	}
	if err := a.s.Write(context.Background(), peer, small); err != nil {
		t.Fatal(err)
	}
	if !a.p.Immediate(peer, small) {
		t.Fatal("a 64-byte shm write on a link that is up is not immediate")
	}
	late, lateFd := engineMemory(t, page)
	b.register(t, late, lateFd)
	many := make([]Triple, immediateTriples+1)
	for i := range many {
		many[i] = Triple{Src: addrOf(src) + uint64(i), Dst: addrOf(dst) + uint64(i), Len: 1}
	}
	for name, ts := range map[string][]Triple{
		"over immediateMax":             {{Src: addrOf(src), Dst: addrOf(dst), Len: immediateMax + 1}},
		"over immediateMax, summed":     {{Src: addrOf(src), Dst: addrOf(dst), Len: immediateMax}, {Src: addrOf(src), Dst: addrOf(dst) + immediateMax, Len: 1}},
		"too many ranges":               many,
		"a destination the table lacks": {{Src: addrOf(src), Dst: addrOf(late), Len: 64}},
		"no ranges":                     nil,
	} {
		if a.p.Immediate(peer, ts) {
			t.Errorf("%s: immediate", name)
		}
	}
	if a.p.Immediate("127.0.0.1:1", small) {
		t.Error("immediate to a peer with no link")
	}
	c, d := newMemSide(t, "tcp", 5*time.Second), newMemSide(t, "tcp", 5*time.Second)
	c.register(t, src, srcFd)
	d.register(t, dst, dstFd)
	if err := c.s.Write(context.Background(), d.p.PeerAddr(), small); err != nil {
		t.Fatal(err)
	}
	if c.p.Immediate(d.p.PeerAddr(), small) {
		t.Error("a tcp write is immediate (it waits for the peer's fence answer)")
	}
}
