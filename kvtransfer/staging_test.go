package kvtransfer

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
)

// stagedPair is two planes on different hosts (host ids) sharing stand-in
// GPUs, with a GPU region registered on each: src on a, dst on b.
type stagedPair struct {
	gpus     *hostGPUs
	a, b     *memSide
	src, dst *hostAlloc
}

const (
	srcBase   = 0x10000000
	dstBase   = 0x20000000
	testChunk = 64 << 10
)

func newStagedPair(t *testing.T, transport string, size int, timeout time.Duration) *stagedPair {
	t.Cleanup(func() { goleak.VerifyNone(t, goleak.IgnoreCurrent()) })
	gpus := newHostGPUs(t)
	chunk := func(c *MemoryConfig) { c.StageChunk = testChunk }
	sp := &stagedPair{gpus: gpus,
		a: newMemSide(t, transport, timeout, func(c *MemoryConfig) { c.GPUs, c.HostID = gpus, "host-a" }, chunk),
		b: newMemSide(t, transport, timeout, func(c *MemoryConfig) { c.GPUs, c.HostID = gpus, "host-b" }, chunk),
	}
	sp.src, sp.dst = gpus.alloc(0, size), gpus.alloc(1, size)
	fill(sp.src.mem, 5)
	sp.a.registerGPU(t, srcBase, sp.src)
	sp.b.registerGPU(t, dstBase, sp.dst)
	return sp
}

// staged asserts every staging buffer of both planes is back in its pool.
func (sp *stagedPair) allReturned(t *testing.T) {
	t.Helper()
	if a, b := sp.a.p.gpu.stagedOut(), sp.b.p.gpu.stagedOut(); a != 0 || b != 0 {
		t.Fatalf("staging buffers out: %d writer, %d receiver", a, b)
	}
}

// everyOther is n pages of pg bytes: source page 2i into destination page
// 2i+1, so no two runs merge.
func everyOther(n int, pg uint64) []Triple {
	ts := make([]Triple, n)
	for i := range ts {
		ts[i] = Triple{Src: srcBase + 2*uint64(i)*pg, Dst: dstBase + (2*uint64(i)+1)*pg, Len: pg}
	}
	return ts
}

func TestStagedWriteAcrossHosts(t *testing.T) {
	for _, tr := range []string{"tcp", "shm"} {
		t.Run(tr, func(t *testing.T) {
			const size, pg = 4 << 20, 4096
			sp := newStagedPair(t, tr, size, 5*time.Second)
			ctx := context.Background()
			// Contiguous, in pages: runs merge, then split into chunks.
			var ts []Triple
			for off := uint64(0); off < size/2; off += pg {
				ts = append(ts, Triple{Src: srcBase + off, Dst: dstBase + off, Len: pg})
			}
			if err := sp.a.s.Write(ctx, sp.b.p.PeerAddr(), ts); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(sp.dst.mem[:size/2], sp.src.mem[:size/2]) {
				t.Fatal("contiguous write: bytes differ")
			}
			if g, mx := sp.gpus.gathers, sp.gpus.maxGather; g != size/2/testChunk || mx != testChunk {
				t.Fatalf("contiguous write: %d gathers of at most %d bytes, want %d of %d", g, mx, size/2/testChunk, testChunk)
			}
			// Every other page, as a page write.
			clear(sp.dst.mem)
			w := &PageWrite{Bufs: []PageBuf{{Src: srcBase, Dst: dstBase, PageLen: pg}}}
			for i := uint32(0); i < 300; i++ {
				w.Pairs = append(w.Pairs, PagePair{Src: 2 * i, Dst: 2*i + 1})
			}
			if err := sp.a.s.WritePages(ctx, sp.b.p.PeerAddr(), w); err != nil {
				t.Fatal(err)
			}
			for i := 0; i < 300; i++ {
				d, s := sp.dst.mem[(2*i+1)*pg:(2*i+2)*pg], sp.src.mem[2*i*pg:(2*i+1)*pg]
				if !bytes.Equal(d, s) || !bytes.Equal(sp.dst.mem[2*i*pg:(2*i+1)*pg], make([]byte, pg)) {
					t.Fatalf("every-other page %d wrong", i)
				}
			}
			sp.allReturned(t)
		})
	}
}

// Triples land in order: a later one over the same destination wins,
// also when the two fall into different chunks.
func TestStagedWriteKeepsOrder(t *testing.T) {
	sp := newStagedPair(t, "tcp", 1<<20, 5*time.Second)
	ts := []Triple{
		{Src: srcBase, Dst: dstBase, Len: 3 * testChunk / 2},
		{Src: srcBase + 4*testChunk, Dst: dstBase + testChunk, Len: testChunk},
	}
	if err := sp.a.s.Write(context.Background(), sp.b.p.PeerAddr(), ts); err != nil {
		t.Fatal(err)
	}
	want := append(bytes.Clone(sp.src.mem[:testChunk]), sp.src.mem[4*testChunk:5*testChunk]...)
	if !bytes.Equal(sp.dst.mem[:2*testChunk], want) {
		t.Fatal("the later triple did not win")
	}
	sp.allReturned(t)
}

// Host memory beside GPU memory: a host source into a remote GPU region,
// and a GPU source into a remote host region.
func TestStagedMixedKinds(t *testing.T) {
	for _, tr := range []string{"tcp", "shm"} {
		t.Run(tr, func(t *testing.T) {
			sp := newStagedPair(t, tr, 1<<20, 5*time.Second)
			hostA, hostB := sp.a.memory(t, 1<<20), sp.b.memory(t, 1<<20)
			fill(hostA, 9)
			ctx := context.Background()
			if err := sp.a.s.Write(ctx, sp.b.p.PeerAddr(), []Triple{{Src: addrOf(hostA), Dst: dstBase + 4096, Len: 200 << 10}}); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(sp.dst.mem[4096:4096+200<<10], hostA[:200<<10]) {
				t.Fatal("host to GPU: bytes differ")
			}
			if err := sp.a.s.Write(ctx, sp.b.p.PeerAddr(), []Triple{{Src: srcBase, Dst: addrOf(hostB) + 8192, Len: 300 << 10}}); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(hostB[8192:8192+300<<10], sp.src.mem[:300<<10]) {
				t.Fatal("GPU to host: bytes differ")
			}
			sp.allReturned(t)
		})
	}
}

// The write returns only once the receiver's last scatter is done.
func TestStagedCompletesAfterLastScatter(t *testing.T) {
	sp := newStagedPair(t, "tcp", 1<<20, 5*time.Second)
	entered, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	sp.gpus.onScatter = func(spans []Span) error {
		if spans[len(spans)-1].Addr+spans[len(spans)-1].Len == sp.dst.base+4*testChunk {
			once.Do(func() { close(entered) })
			<-release
		}
		return nil
	}
	done := make(chan error, 1)
	go func() {
		done <- sp.a.s.Write(context.Background(), sp.b.p.PeerAddr(), []Triple{{Src: srcBase, Dst: dstBase, Len: 4 * testChunk}})
	}()
	<-entered
	select {
	case err := <-done:
		t.Fatalf("write returned (%v) while its last scatter was still running", err)
	case <-time.After(50 * time.Millisecond):
	}
	close(release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(sp.dst.mem[:4*testChunk], sp.src.mem[:4*testChunk]) {
		t.Fatal("bytes differ")
	}
	sp.allReturned(t)
}

// A peer that goes away mid-transfer fails the write promptly and leaves
// no staging buffer out on either side.
func TestStagedPeerDiesMidTransfer(t *testing.T) {
	sp := newStagedPair(t, "tcp", 4<<20, 5*time.Second)
	var once sync.Once
	closed := make(chan error, 1)
	sp.gpus.onGather = func([]Span) error {
		if sp.gpus.gathers == 3 {
			once.Do(func() { go func() { closed <- sp.b.p.Close() }() })
		}
		return nil
	}
	err := sp.a.s.Write(context.Background(), sp.b.p.PeerAddr(), []Triple{{Src: srcBase, Dst: dstBase, Len: 4 << 20}})
	if err == nil {
		t.Fatal("write into a dying peer succeeded")
	}
	if err := <-closed; err != nil {
		t.Fatal(err)
	}
	sp.allReturned(t)
}

// A receiver stuck in a scatter times the write out; once it comes back,
// every buffer is returned.
func TestStagedWriteTimesOut(t *testing.T) {
	sp := newStagedPair(t, "tcp", 1<<20, 200*time.Millisecond)
	release := make(chan struct{})
	sp.gpus.onScatter = func([]Span) error { <-release; return nil }
	start := time.Now()
	err := sp.a.s.Write(context.Background(), sp.b.p.PeerAddr(), []Triple{{Src: srcBase, Dst: dstBase, Len: 1 << 20}})
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("stuck receiver: %v, want a deadline", err)
	}
	if d := time.Since(start); d > 3*time.Second {
		t.Fatalf("timed out after %v", d)
	}
	close(release)
	for sp.b.p.Links() != 0 { // the writer dropped the link; its reader ends
		time.Sleep(time.Millisecond)
	}
	sp.allReturned(t)
}

// A failed scatter or gather fails the write with its cause; the link
// stays usable.
func TestStagedCopyFailures(t *testing.T) {
	sp := newStagedPair(t, "tcp", 1<<20, 5*time.Second)
	ts := []Triple{{Src: srcBase, Dst: dstBase, Len: 3 * testChunk}}
	ctx := context.Background()
	sp.gpus.onScatter = func([]Span) error { return errors.New("device lost") }
	if err := sp.a.s.Write(ctx, sp.b.p.PeerAddr(), ts); err == nil || !strings.Contains(err.Error(), "scatter into GPU memory: device lost") {
		t.Fatalf("failed scatter: %v", err)
	}
	sp.gpus.onScatter = nil
	sp.gpus.onGather = func([]Span) error { return errors.New("bad address") }
	if err := sp.a.s.Write(ctx, sp.b.p.PeerAddr(), ts); err == nil || !strings.Contains(err.Error(), "gather: bad address") {
		t.Fatalf("failed gather: %v", err)
	}
	sp.gpus.onGather = nil
	if err := sp.a.s.Write(ctx, sp.b.p.PeerAddr(), ts); err != nil {
		t.Fatalf("after the failures: %v", err)
	}
	if sp.a.p.Links() != 1 {
		t.Fatalf("%d links, want the one kept", sp.a.p.Links())
	}
	sp.allReturned(t)
}

// A destination that is not registered is dropped at the receiver and
// reported at the fence.
func TestStagedUnknownDestination(t *testing.T) {
	sp := newStagedPair(t, "tcp", 1<<20, 5*time.Second)
	err := sp.a.s.Write(context.Background(), sp.b.p.PeerAddr(), []Triple{{Src: srcBase, Dst: dstBase + 1<<20 - 4096, Len: 8192}})
	if !errors.Is(err, ErrNotRegistered) {
		t.Fatalf("write past the region: %v", err)
	}
	sp.allReturned(t)
}
