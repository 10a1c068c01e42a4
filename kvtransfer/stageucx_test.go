//go:build cgo

package kvtransfer

import (
	"bytes"
	"context"
	"errors"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/pdrouter/pdrouter/ucx"
)

// The receiver's slots are the writer's credits: with the receiver's
// scatters stuck, the writer gathers only as far as the slots it holds
// (plus the chunks already gathered), and once they move every slot comes
// back.
func TestStagedUCXSlotsAreCredits(t *testing.T) {
	sp := newStagedPair(t, "ucx", 4<<20, 5*time.Second)
	release := make(chan struct{})
	var once sync.Once
	sp.gpus.onScatter = func([]Span) error {
		once.Do(func() { <-release })
		return nil
	}
	const chunks = 32
	done := make(chan error, 1)
	go func() {
		done <- sp.a.s.Write(context.Background(), sp.b.p.PeerAddr(), []Triple{{Src: srcBase, Dst: dstBase, Len: chunks * testChunk}})
	}()
	// Gathers stop once the slots run out: stageSlots put, one waiting
	// for a slot, one handed over, one gathered and waiting to be.
	last, still := -1, 0
	for still < 20 {
		time.Sleep(5 * time.Millisecond)
		sp.gpus.mu.Lock()
		g := sp.gpus.gathers
		sp.gpus.mu.Unlock()
		if g == last {
			still++
		} else {
			last, still = g, 0
		}
	}
	if last > stageSlots+3 || last < stageSlots {
		t.Fatalf("%d chunks gathered with the receiver stuck, want %d to %d", last, stageSlots, stageSlots+3)
	}
	close(release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(sp.dst.mem[:chunks*testChunk], sp.src.mem[:chunks*testChunk]) {
		t.Fatal("bytes differ")
	}
	var r *peerRing
	sp.a.p.mu.Lock()
	for l := range sp.a.p.links {
		r = l.ustage.out.Load()
	}
	sp.a.p.mu.Unlock()
	if r == nil || len(r.free) != cap(r.free) {
		t.Fatalf("slots not all back: ring %+v", r)
	}
	sp.allReturned(t)
}

// Over ucx the staged path names itself staged-ucx, and once the planes
// and transports close no UCX object (registration, key, endpoint) and no
// staging buffer or ring is left.
func TestStagedUCXReleasesEverything(t *testing.T) {
	sp := newStagedPair(t, "ucx", 1<<20, 5*time.Second)
	if err := sp.a.s.Write(context.Background(), sp.b.p.PeerAddr(), everyOther(100, 4096)); err != nil {
		t.Fatal(err)
	}
	for i := range 100 {
		if !bytes.Equal(sp.dst.mem[(2*i+1)*4096:(2*i+2)*4096], sp.src.mem[2*i*4096:(2*i+1)*4096]) {
			t.Fatalf("page %d wrong", i)
		}
	}
	st := sp.a.p.Paths()
	found := false
	for _, pp := range st.Links[0].Paths {
		found = found || pp.Src == "cuda:0@host-a" && pp.Dst == "cuda:1@host-b" && pp.Path == PathStagedUCX
	}
	if !found {
		t.Fatalf("paths %+v, want staged-ucx for cuda:0@host-a -> cuda:1@host-b", st.Links[0].Paths)
	}
	sp.viaRing(t, "ucx")
	for _, m := range []*memSide{sp.a, sp.b} {
		if err := m.p.Close(); err != nil {
			t.Fatal(err)
		}
	}
	sp.ringsReturned(t)
	for _, m := range []*memSide{sp.a, sp.b} {
		if err := m.tr.Close(); err != nil {
			t.Fatal(err)
		}
		m.tr = &TCP{}
	}
	if d, s, i := sp.gpus.open(); d != 0 || s != 0 || i != 0 {
		t.Fatalf("left open: %d devices, %d staging buffers, %d IPC mappings", d, s, i)
	}
	if l := ucx.LiveObjects(); l != (ucx.Live{}) {
		t.Fatalf("UCX objects leaked: %+v", l)
	}
}

func init() {
	transports["ucx-noreg"] = func() (Transport, error) {
		u, err := NewUCX()
		if err != nil {
			return nil, err
		}
		return &noRegUCX{u}, nil
	}
}

// noRegUCX is UCX refusing engine memory (a memfd mapping), as UCX 1.13's
// shared-memory transports refuse memory another process mapped, while
// kvproxy's own staging memory registers.
type noRegUCX struct{ *UCX }

func (n *noRegUCX) RegisterMemory(b []byte, fd int) (MemoryRegistration, error) {
	if fd >= 0 {
		return nil, errors.New("ucp_mem_map: unsupported operation")
	}
	return n.UCX.RegisterMemory(b, fd)
}

// Host engine memory UCX cannot register still registers, and writes into
// and out of it go through the staging rings: here both ends, GPU-less
// planes, so the receiver lends a ring of host memory.
func TestStagedUCXUnregisteredHostMemory(t *testing.T) {
	t.Cleanup(func() { goleak.VerifyNone(t, goleak.IgnoreCurrent()) })
	t.Setenv("UCX_TLS", "tcp")
	a := newMemSide(t, "ucx-noreg", 5*time.Second, withPuts(true))
	b := newMemSide(t, "ucx-noreg", 5*time.Second, withPuts(true))
	const size = 3<<20 + 4096 // more than one 1 MiB slot, not a whole number of them
	src, srcFd := engineMemory(t, size)
	dst, dstFd := engineMemory(t, size)
	fill(src, 6)
	a.register(t, src, srcFd)
	b.register(t, dst, dstFd)
	ts := []Triple{{Src: addrOf(src), Dst: addrOf(dst) + 4096, Len: size - 8192}, {Src: addrOf(src) + size - 4096, Dst: addrOf(dst), Len: 4096}}
	if err := a.s.Write(context.Background(), b.p.PeerAddr(), ts); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(dst[4096:size-4096], src[:size-8192]) || !bytes.Equal(dst[:4096], src[size-4096:]) {
		t.Fatal("bytes differ")
	}
	if bufs, rings := b.p.gpu.stagedOut(); rings != 1 || bufs != 0 {
		t.Fatalf("receiver: %d rings lent, %d buffers out; want the one ring", rings, bufs)
	}
	if bufs, _ := a.p.gpu.stagedOut(); bufs != 0 {
		t.Fatalf("writer: %d staging buffers out", bufs)
	}
}

// Over UCX's tcp lanes alone (no rc or dc, no puts asked for) UCX's puts
// are emulations slower than DATA frames on the link: GPU bytes go as
// frames, no ring is lent, and the link says staged-tcp.
func TestStagedUCXWithoutRMAUsesFrames(t *testing.T) {
	t.Cleanup(func() { goleak.VerifyNone(t, goleak.IgnoreCurrent()) })
	t.Setenv("UCX_TLS", "tcp")
	gpus := newHostGPUs(t)
	a := gpuSide(t, gpus, "ucx", "host-a", 5*time.Second)
	b := gpuSide(t, gpus, "ucx", "host-b", 5*time.Second)
	src, dst := gpus.alloc(0, 1<<20), gpus.alloc(1, 1<<20)
	fill(src.mem, 8)
	a.registerGPU(t, srcBase, src)
	b.registerGPU(t, dstBase, dst)
	if err := a.s.Write(context.Background(), b.p.PeerAddr(), everyOther(50, 4096)); err != nil {
		t.Fatal(err)
	}
	for i := range 50 {
		if !bytes.Equal(dst.mem[(2*i+1)*4096:(2*i+2)*4096], src.mem[2*i*4096:(2*i+1)*4096]) {
			t.Fatalf("page %d wrong", i)
		}
	}
	if _, rings := b.p.gpu.stagedOut(); rings != 0 {
		t.Fatalf("%d rings lent without puts", rings)
	}
	if p := a.p.Paths().Links[0].Paths; !slices.ContainsFunc(p, func(pp PairPath) bool {
		return pp.Src == "cuda:0@host-a" && pp.Dst == "cuda:1@host-b" && pp.Path == PathStagedTCP
	}) {
		t.Fatalf("paths %+v, want staged-tcp", p)
	}
}

// Over UCX's tcp lanes every put in flight completes together with the
// last one posted, so a ring no larger than the window of puts in flight
// emptied on every round and the wire stopped while the receiver scattered
// and handed the slots back. The ring holds two windows: with the receiver
// stuck on its first scatter, a second window of puts still goes out.
func TestStagedUCXNextWindowWhileScattering(t *testing.T) {
	t.Cleanup(func() { goleak.VerifyNone(t, goleak.IgnoreCurrent()) })
	t.Setenv("UCX_TLS", "tcp")
	gpus := newHostGPUs(t)
	side := func(tr, host string) *memSide {
		return newMemSide(t, tr, 5*time.Second, func(c *MemoryConfig) {
			c.GPUs, c.HostID, c.StageChunk, c.TransportPuts = gpus, host, testChunk, true
		})
	}
	a, b := side("ucx-counted", "host-a"), side("ucx", "host-b")
	const chunks = 32
	src, dst := gpus.alloc(0, chunks*testChunk), gpus.alloc(1, chunks*testChunk)
	fill(src.mem, 9)
	a.registerGPU(t, srcBase, src)
	b.registerGPU(t, dstBase, dst)
	release := make(chan struct{})
	var once sync.Once
	gpus.onScatter = func([]Span) error {
		once.Do(func() { <-release })
		return nil
	}
	done := make(chan error, 1)
	go func() {
		done <- a.s.Write(context.Background(), b.p.PeerAddr(), []Triple{{Src: srcBase, Dst: dstBase, Len: chunks * testChunk}})
	}()
	puts := a.tr.(*countedUCX)
	for deadline := time.Now().Add(3 * time.Second); puts.done.Load() < 2*stageWindow && time.Now().Before(deadline); {
		time.Sleep(time.Millisecond)
	}
	last, most := puts.done.Load(), puts.most.Load()
	close(release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(dst.mem, src.mem) {
		t.Fatal("bytes differ")
	}
	if most > stageWindow {
		t.Fatalf("%d puts in flight at once, want at most %d", most, stageWindow)
	}
	if last < 2*stageWindow {
		t.Fatalf("%d puts done while the receiver scattered the first slot, want a second window (%d)", last, 2*stageWindow)
	}
}

func init() {
	transports["ucx-counted"] = func() (Transport, error) {
		u, err := NewUCX()
		if err != nil {
			return nil, err
		}
		return &countedUCX{UCX: u}, nil
	}
}

// countedUCX counts its endpoints' puts: done, in flight, most in flight,
// and how long at least one was in flight.
type countedUCX struct {
	*UCX
	done, flying, most atomic.Int64
	mu                 sync.Mutex
	busySince          time.Time
	busy               time.Duration
}

// busyFor is how long puts were in flight so far.
func (c *countedUCX) busyFor() time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.busy
}

func (c *countedUCX) MemoryEndpoint(addr []byte) (MemoryEndpoint, error) {
	ep, err := c.UCX.MemoryEndpoint(addr)
	if err != nil {
		return nil, err
	}
	return &countedEndpoint{MemoryEndpoint: ep, c: c}, nil
}

type countedEndpoint struct {
	MemoryEndpoint
	c *countedUCX
}

func (e *countedEndpoint) Put(ctx context.Context, ops []MemoryOp) error {
	c := e.c
	c.mu.Lock()
	n := c.flying.Add(1)
	if n == 1 {
		c.busySince = time.Now()
	}
	c.most.Store(max(c.most.Load(), n))
	c.mu.Unlock()
	err := e.MemoryEndpoint.Put(ctx, ops)
	c.mu.Lock()
	if c.flying.Add(-1) == 0 {
		c.busy += time.Since(c.busySince)
	}
	c.done.Add(1)
	c.mu.Unlock()
	return err
}
