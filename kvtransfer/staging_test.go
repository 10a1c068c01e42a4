package kvtransfer

import (
	"bytes"
	"context"
	"errors"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/pdrouter/pdrouter/kvtransfer/wire"
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

// stagedOut is the number of staging buffers (and rings) handed out on
// every device.
func (g *gpuPlane) stagedOut() (bufs, rings int) {
	g.mu.Lock()
	pools := make([]*stagePool, 0, len(g.pools))
	for _, sp := range g.pools {
		pools = append(pools, sp)
	}
	g.mu.Unlock()
	for _, sp := range pools {
		b, r := sp.outstanding()
		bufs, rings = bufs+b, rings+r
	}
	return bufs, rings
}

// outstanding counts buffers and rings handed out and not yet returned.
func (sp *stagePool) outstanding() (bufs, rings int) {
	sp.mu.Lock()
	defer sp.mu.Unlock()
	return sp.out, sp.lent
}

func newStagedPair(t *testing.T, transport string, size int, timeout time.Duration) *stagedPair {
	t.Cleanup(func() { goleak.VerifyNone(t, goleak.IgnoreCurrent()) })
	if transport == "ucx" {
		t.Setenv("UCX_TLS", "tcp") // the NIC-less stand-in for rc: puts asked for
	}
	gpus := newHostGPUs(t)
	chunk := func(c *MemoryConfig) { c.StageChunk, c.TransportPuts = testChunk, transport == "ucx" }
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

// allReturned asserts every staging buffer of both planes is back in its
// pool (rings stay lent as long as their links).
func (sp *stagedPair) allReturned(t *testing.T) {
	t.Helper()
	a, _ := sp.a.p.gpu.stagedOut()
	b, _ := sp.b.p.gpu.stagedOut()
	if a != 0 || b != 0 {
		t.Fatalf("staging buffers out: %d writer, %d receiver", a, b)
	}
}

// ringsReturned asserts no plane lends a ring any more (its links are gone).
func (sp *stagedPair) ringsReturned(t *testing.T) {
	t.Helper()
	for _, m := range []*memSide{sp.a, sp.b} {
		deadline := time.Now().Add(5 * time.Second)
		for _, r := m.p.gpu.stagedOut(); r != 0; _, r = m.p.gpu.stagedOut() {
			if time.Now().After(deadline) {
				t.Fatalf("%d staging rings still lent", r)
			}
			time.Sleep(time.Millisecond)
		}
	}
}

// viaRing asserts how the GPU bytes crossed: over ucx by RMA into the
// receiver's ring (no DATA frame staged by its reader), else as DATA
// frames.
func (sp *stagedPair) viaRing(t *testing.T, transport string) {
	t.Helper()
	_, rings := sp.b.p.gpu.stagedOut()
	_, framed := sp.b.p.gpu.pools[1] // DATA frames for GPU 1 land in its pool
	if ucx := transport == "ucx"; (rings == 1) != ucx || framed == ucx {
		t.Fatalf("over %s: %d rings lent, DATA frames staged %t", transport, rings, framed)
	}
}

// stagedTransports are the transports the staged path runs over.
var stagedTransports = []string{"tcp", "shm", "ucx"}

// eachTransport runs f as a subtest per transport in names.
func eachTransport(t *testing.T, names []string, f func(t *testing.T, tr string)) {
	for _, tr := range names {
		t.Run(tr, func(t *testing.T) { f(t, tr) })
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
	for _, tr := range stagedTransports {
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
			sp.viaRing(t, tr)
			sp.allReturned(t)
		})
	}
}

// Triples land in order: a later one over the same destination wins,
// also when the two fall into different chunks.
func TestStagedWriteKeepsOrder(t *testing.T) {
	eachTransport(t, []string{"tcp", "ucx"}, testStagedWriteKeepsOrder)
}

func testStagedWriteKeepsOrder(t *testing.T, tr string) {
	sp := newStagedPair(t, tr, 1<<20, 5*time.Second)
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
	for _, tr := range stagedTransports {
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
			sp.viaRing(t, tr)
			sp.allReturned(t)
		})
	}
}

// The write returns only once the receiver's last scatter is done.
func TestStagedCompletesAfterLastScatter(t *testing.T) {
	eachTransport(t, []string{"tcp", "ucx"}, testStagedCompletesAfterLastScatter)
}

func testStagedCompletesAfterLastScatter(t *testing.T, tr string) {
	sp := newStagedPair(t, tr, 1<<20, 5*time.Second)
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
	eachTransport(t, []string{"tcp", "ucx"}, testStagedPeerDiesMidTransfer)
}

func testStagedPeerDiesMidTransfer(t *testing.T, tr string) {
	sp := newStagedPair(t, tr, 4<<20, 5*time.Second)
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
	sp.ringsReturned(t)
}

// A receiver stuck in a scatter times the write out; once it comes back,
// every buffer is returned.
func TestStagedWriteTimesOut(t *testing.T) {
	eachTransport(t, []string{"tcp", "ucx"}, testStagedWriteTimesOut)
}

func testStagedWriteTimesOut(t *testing.T, tr string) {
	sp := newStagedPair(t, tr, 1<<20, 200*time.Millisecond)
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
	// The writer dropped the link; its reader ends, scattering what it had
	// queued after the link left the table, then returning the buffers.
	deadline := time.Now().Add(5 * time.Second)
	for out, _ := sp.b.p.gpu.stagedOut(); sp.b.p.Links() != 0 || out != 0; out, _ = sp.b.p.gpu.stagedOut() {
		if time.Now().After(deadline) {
			break // allReturned says what is still out
		}
		time.Sleep(time.Millisecond)
	}
	sp.allReturned(t)
	sp.ringsReturned(t)
}

// A failed scatter or gather fails the write with its cause; the link
// stays usable.
func TestStagedCopyFailures(t *testing.T) {
	eachTransport(t, []string{"tcp", "ucx"}, testStagedCopyFailures)
}

func testStagedCopyFailures(t *testing.T, tr string) {
	sp := newStagedPair(t, tr, 1<<20, 5*time.Second)
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
	eachTransport(t, []string{"tcp", "ucx"}, testStagedUnknownDestination)
}

func testStagedUnknownDestination(t *testing.T, tr string) {
	sp := newStagedPair(t, tr, 1<<20, 5*time.Second)
	err := sp.a.s.Write(context.Background(), sp.b.p.PeerAddr(), []Triple{{Src: srcBase, Dst: dstBase + 1<<20 - 4096, Len: 8192}})
	if !errors.Is(err, ErrNotRegistered) {
		t.Fatalf("write past the region: %v", err)
	}
	sp.allReturned(t)
}

// Two kvproxies of one host whose GPUs lack peer access: the writer copies
// through its own staging buffers into the peer engine's device, in
// chunks, and the receiver's reader stages nothing; a failed scatter fails
// the write with its cause.
func TestStagedLocalBetweenKVProxies(t *testing.T) {
	t.Cleanup(func() { goleak.VerifyNone(t, goleak.IgnoreCurrent()) })
	gpus := newHostGPUs(t)
	gpus.noPeer = true
	chunk := func(c *MemoryConfig) { c.StageChunk = testChunk }
	a := newMemSide(t, "tcp", 5*time.Second, func(c *MemoryConfig) { c.GPUs, c.HostID = gpus, "h1" }, chunk)
	b := newMemSide(t, "tcp", 5*time.Second, func(c *MemoryConfig) { c.GPUs, c.HostID = gpus, "h1" }, chunk)
	src, dst := gpus.alloc(0, 1<<20), gpus.alloc(1, 1<<20)
	fill(src.mem, 4)
	a.registerGPU(t, srcBase, src)
	b.registerGPU(t, dstBase, dst)
	ctx := context.Background()
	if err := a.s.Write(ctx, b.p.PeerAddr(), everyOther(64, 4096)); err != nil {
		t.Fatal(err)
	}
	for i := range 64 {
		if !bytes.Equal(dst.mem[(2*i+1)*4096:(2*i+2)*4096], src.mem[2*i*4096:(2*i+1)*4096]) {
			t.Fatalf("page %d wrong", i)
		}
	}
	if gpus.gathers != 64*4096/testChunk || gpus.maxGather != testChunk {
		t.Fatalf("%d gathers of at most %d bytes, want %d of %d", gpus.gathers, gpus.maxGather, 64*4096/testChunk, testChunk)
	}
	if len(b.p.gpu.pools) != 0 {
		t.Fatal("the receiver staged bytes: they crossed the link")
	}
	// The destination stays mapped: the next write opens nothing.
	opened := gpus.opened
	if err := a.s.Write(ctx, b.p.PeerAddr(), everyOther(4, 4096)); err != nil {
		t.Fatal(err)
	}
	if gpus.opened != opened {
		t.Fatalf("a second write opened %d IPC mappings", gpus.opened-opened)
	}
	gpus.onScatter = func([]Span) error { return errors.New("device lost") }
	if err := a.s.Write(ctx, b.p.PeerAddr(), []Triple{{Src: srcBase, Dst: dstBase, Len: 3 * testChunk}}); err == nil || !strings.Contains(err.Error(), "device lost") {
		t.Fatalf("failed scatter: %v", err)
	}
	gpus.onScatter = nil
	if out, _ := a.p.gpu.stagedOut(); out != 0 {
		t.Fatalf("%d staging buffers out", out)
	}
	if p := a.p.Paths().Links[0].Paths; !slices.ContainsFunc(p, func(pp PairPath) bool {
		return pp.Src == "cuda:0@h1" && pp.Dst == "cuda:1@h1" && pp.Path == PathStagedLocal
	}) {
		t.Fatalf("paths %+v, want staged-local", p)
	}
}

// A receiver without GPU memory lends a ring of host memory; a MEM_STAGED
// or MEM_STAGE_FREE for a slot never lent is a broken peer: the link goes.
func TestStagingProtocolViolations(t *testing.T) {
	b := newMemSide(t, "tcp", 2*time.Second)
	for _, bad := range []wire.Msg{&wire.MemStaged{Slot: 4, Pieces: []wire.StagedPiece{{Region: 1, N: 8}}}, &wire.MemStageFree{Slot: 2}} {
		ours, peer, l := pipeLink(t, b)
		_ = ours.SetDeadline(time.Now().Add(5 * time.Second))
		go func() { _ = peer.Write(&wire.MemStageReq{Seq: 1, SlotLen: 1 << 20, Slots: 4}) }()
		m, err := peer.Read()
		if a, ok := m.(*wire.MemStageRing); err != nil || !ok || a.Seq != 1 || a.Err != "" || a.Slots != 4 || a.SlotLen != 1<<20 {
			t.Fatalf("ring request: %#v %v", m, err)
		}
		go func() { _ = peer.Write(bad) }()
		if m, err := peer.Read(); err == nil {
			t.Fatalf("%s: link kept, read %s", bad.Type(), m.Type())
		}
		<-l.gone
		if !strings.Contains(l.err.Error(), "not lent") {
			t.Fatalf("%s: link closed by %v", bad.Type(), l.err)
		}
	}
	for _, l := b.p.gpu.stagedOut(); l != 0; _, l = b.p.gpu.stagedOut() {
		time.Sleep(time.Millisecond) // the readers end, the rings come back
	}
}

// An inline MEM_STAGED must be followed by its DATA frame, of exactly its
// pieces' length: anything else is a broken peer and the link goes.
func TestStagedInlineNeedsItsData(t *testing.T) {
	b := newMemSide(t, "tcp", 2*time.Second)
	staged := &wire.MemStaged{Slot: wire.InlineSlot, Pieces: []wire.StagedPiece{{Region: 1, N: 8}, {Region: 1, Offset: 64, N: 8}}}
	for _, next := range []func(c *wire.Conn) error{
		func(c *wire.Conn) error { return c.Write(&wire.MemFence{Seq: 1}) },
		func(c *wire.Conn) error { return c.WriteData(0, 0, make([]byte, 8)) },
		func(c *wire.Conn) error { return c.WriteData(7, 0, make([]byte, 16)) },
	} {
		ours, peer, l := pipeLink(t, b)
		_ = ours.SetDeadline(time.Now().Add(5 * time.Second))
		go func() {
			if peer.Write(staged) == nil {
				_ = next(peer)
			}
		}()
		<-l.gone
		if !errors.Is(l.err, wire.ErrMalformed) {
			t.Fatalf("link closed by %v, want a malformed stream", l.err)
		}
	}
}
