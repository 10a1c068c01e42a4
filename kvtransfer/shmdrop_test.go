package kvtransfer

import (
	"bytes"
	"context"
	"testing"
	"time"
)

// A write over shm into a region the peer dropped while its table push is
// still on the way (the writer holds the key it cached) lands in the old
// mapping, which the engine no longer reads: it must fail, as tcp's does,
// not report the bytes delivered.
func TestSHMWriteIntoADroppedRegionFails(t *testing.T) {
	a, b, src, dst := newMemPair(t, "shm", 2*time.Second, 4*page, 9)
	ctx := context.Background()
	write := func() error {
		return a.s.Write(ctx, b.p.PeerAddr(), []Triple{{Src: addrOf(src), Dst: addrOf(dst), Len: 4 * page}})
	}
	if err := write(); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(dst, src) {
		t.Fatal("shm write did not land")
	}
	// Dropped without the push reaching a yet.
	b.p.mu.Lock()
	r := b.p.findLocked(addrOf(dst), 1)
	b.p.mu.Unlock()
	if err := b.p.drop(r, false); err != nil {
		t.Fatal(err)
	}
	if err := write(); err == nil {
		t.Fatal("a write into a region the peer dropped reported success")
	}
	// Registered again, it is written again.
	dst2 := b.memory(t, 4*page)
	if err := a.s.Write(ctx, b.p.PeerAddr(), []Triple{{Src: addrOf(src), Dst: addrOf(dst2), Len: 4 * page}}); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(dst2, src) {
		t.Fatal("shm write into the new region did not land")
	}
}
