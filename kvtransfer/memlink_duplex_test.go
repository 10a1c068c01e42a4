package kvtransfer

import (
	"bytes"
	"context"
	"sync"
	"testing"
	"time"
)

// Bulk writes both ways on one tcp link: each side's reader must keep
// reading while its own writer is blocked on a full socket, so a fence's
// ack cannot wait behind that writer (the two readers would then wait on
// each other until the write timeout).
func TestTCPDuplexBulkWritesDoNotStall(t *testing.T) {
	const half = 16 << 20
	a, b := newMemSide(t, "tcp", time.Minute), newMemSide(t, "tcp", time.Minute)
	am, bm := a.memory(t, 2*half), b.memory(t, 2*half)
	fill(am[:half], 1)
	fill(bm[:half], 2)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	// a dials the link; b's writes then go over the one a dialed.
	if err := a.s.Write(ctx, b.p.PeerAddr(), []Triple{{Src: addrOf(am), Dst: addrOf(bm) + half, Len: page}}); err != nil {
		t.Fatal(err)
	}
	const writers, chunk = 4, half / 4
	var wg sync.WaitGroup
	errs := make(chan error, 2*writers)
	for _, dir := range []struct {
		from     *memSide
		src, dst []byte
		to       string
	}{{a, am, bm, b.p.PeerAddr()}, {b, bm, am, a.p.PeerAddr()}} {
		for w := range writers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				off := uint64(w * chunk)
				for range 4 {
					if err := dir.from.s.Write(ctx, dir.to, []Triple{{Src: addrOf(dir.src) + off, Dst: addrOf(dir.dst) + half + off, Len: chunk}}); err != nil {
						errs <- err
						return
					}
				}
			}()
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatalf("duplex bulk write: %v", err)
	}
	if !bytes.Equal(bm[half:], am[:half]) || !bytes.Equal(am[half:], bm[:half]) {
		t.Fatal("duplex writes did not land")
	}
	if a.p.Links() != 1 || b.p.Links() != 1 {
		t.Fatalf("links %d %d, want the one", a.p.Links(), b.p.Links())
	}
}
