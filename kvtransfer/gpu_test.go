package kvtransfer

import (
	"bytes"
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/pdrouter/pdrouter/cuda"
	"github.com/pdrouter/pdrouter/kvtransfer/wire"
)

func TestRegisterCUDAChecksArguments(t *testing.T) {
	m := newMemSide(t, "tcp", time.Second)
	h := make([]byte, cuda.HandleSize)
	for _, tc := range []struct {
		name         string
		addr, n, off uint64
		handle       []byte
		want         string
	}{
		{"short handle", 1 << 40, 4096, 0, make([]byte, 10), "handle of 10 bytes"},
		{"empty", 1 << 40, 0, 0, h, "bad range"},
		{"wraps", 1<<64 - 4096, 8192, 0, h, "bad range"},
		{"offset past address", 4096, 4096, 8192, h, "bad range"},
		{"too large", 1 << 40, maxMemoryRegion + 1, 0, h, "too large"},
	} {
		if err := m.s.RegisterCUDA(tc.addr, tc.n, tc.handle, tc.off); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want %q", tc.name, err, tc.want)
		}
	}
	if g := m.gauge(); g != 0 {
		t.Fatalf("registered regions %v after refused registrations", g)
	}
}

// Without a driver (CI) the cuda kind fails cleanly naming the cause; with
// one (the GPU machine) a handle no process exported fails to open. Either
// way nothing stays registered.
func TestRegisterCUDAFailsCleanly(t *testing.T) {
	m := newMemSide(t, "tcp", time.Second)
	err := m.s.RegisterCUDA(1<<40, 4096, make([]byte, cuda.HandleSize), 0)
	if cuda.Load() != nil {
		if !errors.Is(err, cuda.ErrNoDriver) || !strings.Contains(err.Error(), "register cuda memory") {
			t.Fatalf("without a driver: %v", err)
		}
	} else if err == nil || !strings.Contains(err.Error(), "open IPC handle") {
		t.Fatalf("bogus handle: %v", err)
	}
	if g := m.gauge(); g != 0 {
		t.Fatalf("registered regions %v after a failed registration", g)
	}
	if err := m.s.Unregister(1 << 40); !errors.Is(err, ErrNotRegistered) {
		t.Fatalf("unregister of a failed registration: %v", err)
	}
}

// A handle whose memory the driver cannot place fails the registration
// and is closed again (importHomeLocked used to keep it open).
func TestRegisterCUDAClosesWhatItCannotLocate(t *testing.T) {
	gpus := newHostGPUs(t)
	m := gpuSide(t, gpus, "tcp", "h1", time.Second)
	a := gpus.alloc(0, 1<<20)
	gpus.mu.Lock()
	gpus.noPlace = true
	gpus.mu.Unlock()
	if err := m.s.RegisterCUDA(0x10000000, 1<<20, a.handle[:], 0); err == nil || !strings.Contains(err.Error(), "not an allocation") {
		t.Fatalf("registering memory Locate cannot place: %v", err)
	}
	if _, _, ipc := gpus.open(); ipc != 0 {
		t.Fatalf("%d IPC mappings left open by a failed registration", ipc)
	}
}

// Unregister drops the GPU region holding an address, for its own
// session only, and closes its IPC mapping.
func TestUnregisterCUDA(t *testing.T) {
	gpus := newHostGPUs(t)
	m := gpuSide(t, gpus, "tcp", "h1", time.Second)
	a := gpus.alloc(0, 1<<20)
	m.registerGPU(t, 0x10000000, a)
	other := m.p.NewSession()
	defer other.Close()
	if err := other.Unregister(0x10000000); !errors.Is(err, ErrNotRegistered) {
		t.Fatalf("another session unregistered the region: %v", err)
	}
	if err := m.s.Unregister(0x10000000 + 4096); err != nil {
		t.Fatalf("unregister by an address inside the region: %v", err)
	}
	if g := m.gauge(); g != 0 {
		t.Fatalf("registered regions %v after unregister", g)
	}
	if _, _, ipc := gpus.open(); ipc != 0 {
		t.Fatalf("%d IPC mappings left open after unregister", ipc)
	}
	if err := m.s.Unregister(0x10000000); !errors.Is(err, ErrNotRegistered) {
		t.Fatalf("second unregister: %v", err)
	}
}

func TestGPUKeyRoundTrip(t *testing.T) {
	var h cuda.Handle
	for i := range h {
		h[i] = byte(i + 1)
	}
	k := gpuKey(h, 12345, 3, "boot-id")
	h2, off, dev, host, err := parseGPUKey(k)
	if err != nil || !bytes.Equal(h2[:], h[:]) || off != 12345 || dev != 3 || host != "boot-id" {
		t.Fatalf("round trip: %x %d %d %q %v", h2, off, dev, host, err)
	}
	if _, _, _, _, err := parseGPUKey(k[:75]); err == nil {
		t.Fatal("short key parsed")
	}
}

// fakeGPU is a gpuPlane with two registered source regions and a link
// whose peer table holds two GPU regions already opened here, so resolve
// runs without a GPU.
func fakeGPU() (*gpuPlane, *memLink) {
	const mib = 1 << 20
	g := &gpuPlane{peers: map[gpuPeerKey]gpuPeer{}}
	dev := &hostDevice{h: &hostGPUs{}}
	g.regions = []*gpuRegion{
		{id: 1, base: 0x10000000, n: 64 * mib, ptr: 0x7000000000, dev: dev},
		{id: 2, base: 0x20000000, n: 64 * mib, ptr: 0x7100000000 + 4096, dev: dev}, // 4 KiB into its allocation
	}
	l := &memLink{regions: []wire.MemRegion{
		{ID: 7, Kind: wire.MemCUDA, Base: 0x30000000, Len: 64 * mib},
		{ID: 8, Kind: wire.MemCUDA, Base: 0x40000000, Len: 64 * mib},
		{ID: 9, Kind: wire.MemHost, Base: 0x50000000, Len: 64 * mib},
	}}
	// Region 8 shares region 7's allocation, 64 MiB in: the cache must keep
	// each region's own address.
	imp := &gpuImport{ptr: 0x9000000000, refs: 2}
	g.peers[gpuPeerKey{l, 7, 0}] = gpuPeer{imp: imp, ptr: imp.ptr}
	g.peers[gpuPeerKey{l, 8, 0}] = gpuPeer{imp: imp, ptr: imp.ptr + 64*mib}
	return g, l
}

func TestGPUResolveMergesAndTranslates(t *testing.T) {
	g, l := fakeGPU()
	const pg = 32 << 10
	var ts []Triple
	for i := uint64(0); i < 4; i++ { // contiguous on both sides: one run
		ts = append(ts, Triple{Src: 0x10000000 + i*pg, Dst: 0x30000000 + i*pg, Len: pg})
	}
	for i := uint64(0); i < 3; i++ { // every other page: three runs
		ts = append(ts, Triple{Src: 0x20000000 + 2*i*pg, Dst: 0x40000000 + 2*i*pg, Len: pg})
	}
	ts = append(ts, Triple{Src: 0x10000000, Dst: 0x40000000, Len: 0}) // empty: skipped
	runs, srcs, total, err := g.resolve(context.Background(), l, g.regions[0].dev, ts, nil, nil)
	for _, r := range srcs {
		r.use.RUnlock()
	}
	if err != nil {
		t.Fatal(err)
	}
	want := []cuda.Run{
		{Src: 0x7000000000, Dst: 0x9000000000, Len: 4 * pg},
		{Src: 0x7100000000 + 4096, Dst: 0x9000000000 + 64<<20, Len: pg},
		{Src: 0x7100000000 + 4096 + 2*pg, Dst: 0x9000000000 + 64<<20 + 2*pg, Len: pg},
		{Src: 0x7100000000 + 4096 + 4*pg, Dst: 0x9000000000 + 64<<20 + 4*pg, Len: pg},
	}
	if !slices.Equal(runs, want) || total != 7*pg || len(srcs) != 2 {
		t.Fatalf("runs %x total %d srcs %d", runs, total, len(srcs))
	}
}

// Parts of one write share the source locks: a region is read-locked once,
// however many parts name it, so a drop waiting in between cannot deadlock.
func TestGPUResolvePartsLockOnce(t *testing.T) {
	g, l := fakeGPU()
	part := []Triple{{Src: 0x10000000, Dst: 0x30000000, Len: 4096}}
	_, srcs, _, err := g.resolve(context.Background(), l, g.regions[0].dev, part, nil, nil)
	if err == nil {
		_, srcs, _, err = g.resolve(context.Background(), l, g.regions[0].dev, part, nil, srcs)
	}
	if err != nil || len(srcs) != 1 {
		t.Fatalf("srcs %d, %v", len(srcs), err)
	}
	srcs[0].use.RUnlock()
	if !srcs[0].use.TryLock() {
		t.Fatal("source still read-locked after one unlock: locked once per part")
	}
}

func TestGPUResolveRejects(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name string
		t    Triple
		want string
	}{
		{"unregistered source", Triple{Src: 0x60000000, Dst: 0x30000000, Len: 8}, "not registered"},
		{"source past its region", Triple{Src: 0x10000000 + 64<<20 - 4, Dst: 0x30000000, Len: 8}, "not registered"},
		{"host destination", Triple{Src: 0x10000000, Dst: 0x50000000, Len: 8}, "staged path"},
		{"wrapping range", Triple{Src: 1<<64 - 4, Dst: 0x30000000, Len: 8}, "wraps"},
	} {
		g, l := fakeGPU()
		_, srcs, _, err := g.resolve(ctx, l, g.regions[0].dev, []Triple{tc.t}, nil, nil)
		for _, r := range srcs {
			r.use.RUnlock()
		}
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want %q", tc.name, err, tc.want)
		}
	}
	// An unknown destination asks the peer once; a closed link fails that.
	g, l := fakeGPU()
	l.closed, l.err = true, errors.New("link gone")
	if _, _, _, err := g.resolve(ctx, l, g.regions[0].dev, []Triple{{Src: 0x10000000, Dst: 0x70000000, Len: 8}}, nil, nil); err == nil || !strings.Contains(err.Error(), "link gone") {
		t.Fatalf("unknown destination on a closed link: %v", err)
	}
}

// BenchmarkGPUResolveScattered is 4k tokens of every other page of the
// Llama-3.1-8B layout in one buffer pair: 256 triples per 32 KiB page run.
func BenchmarkGPUResolveScattered(b *testing.B) {
	g, l := fakeGPU()
	const pg = 32 << 10
	ts := make([]Triple, 16384)
	for i := range ts {
		o := uint64(i%512) * 2 * pg
		ts[i] = Triple{Src: 0x10000000 + o, Dst: 0x30000000 + o, Len: pg}
	}
	var runs []cuda.Run
	b.ResetTimer()
	for range b.N {
		var err error
		var srcs []*gpuRegion
		runs, srcs, _, err = g.resolve(context.Background(), l, g.regions[0].dev, ts, runs[:0], nil)
		for _, r := range srcs {
			r.use.RUnlock()
		}
		if err != nil {
			b.Fatal(err)
		}
	}
}

// A peer's table carries GPU keys: any bytes parse or fail cleanly, and
// what parses packs back to the same key.
func FuzzParseGPUKey(f *testing.F) {
	var h cuda.Handle
	h[0], h[63] = 1, 2
	f.Add(gpuKey(h, 4096, 3, "boot-id"))
	f.Add(gpuKey(h, 0, -1, ""))
	f.Add([]byte{1, 2, 3})
	f.Fuzz(func(t *testing.T, k []byte) {
		h, off, dev, host, err := parseGPUKey(k)
		if err != nil {
			return
		}
		if got := gpuKey(h, off, dev, host); !bytes.Equal(got, k) {
			t.Fatalf("key %x parsed and packed back as %x", k, got)
		}
		if pl := peerPlace(wire.MemRegion{Kind: wire.MemCUDA, RKey: k}); pl.Device != dev || pl.Host != host {
			t.Fatalf("place %+v, want device %d host %q", pl, dev, host)
		}
	})
}

// TestGPUMetricsOnThePlaneRegistry: the GPU write counters are the plane's
// metrics, built with it and registered on its registry under the names
// they always had; two planes in one process each have their own, and a
// plane without a registry keeps them unexported.
func TestGPUMetricsOnThePlaneRegistry(t *testing.T) {
	gpus := newHostGPUs(t)
	a := gpuSide(t, gpus, "tcp", "h1", 2*time.Second)
	b := gpuSide(t, gpus, "tcp", "h1", 2*time.Second)
	quiet := newMemSide(t, "tcp", 2*time.Second, func(c *MemoryConfig) { c.GPUs, c.HostID, c.Registry = gpus, "h1", nil })
	gpuSeries := []string{"kvproxy_gpu_write_resolve_seconds_total", "kvproxy_gpu_write_copy_seconds_total"}
	for _, m := range []*memSide{a, b} {
		for _, name := range append(gpuSeries, "kvproxy_registered_regions", "kvproxy_registered_bytes", "kvproxy_peers", "kvproxy_memory_write_bytes_total") {
			if v := m.metric(t, name); v != 0 {
				t.Fatalf("%s = %v before any write, want exported at 0", name, v)
			}
		}
	}
	src, dst := gpus.alloc(0, 1<<20), gpus.alloc(0, 1<<20)
	a.registerGPU(t, 0x10000000, src)
	b.registerGPU(t, 0x20000000, dst)
	quiet.registerGPU(t, 0x30000000, gpus.alloc(0, 1<<20))
	for w, from := range map[*memSide]uint64{a: 0x10000000, quiet: 0x30000000} {
		if err := w.s.Write(context.Background(), b.p.PeerAddr(), []Triple{{Src: from, Dst: 0x20000000, Len: 4096}}); err != nil {
			t.Fatal(err)
		}
	}
	if a.metric(t, gpuSeries[0])+a.metric(t, gpuSeries[1]) <= 0 {
		t.Fatal("the writer's GPU time counters did not move")
	}
	if b.metric(t, gpuSeries[0]) != 0 || b.metric(t, gpuSeries[1]) != 0 {
		t.Fatal("the receiver's counters moved with the writer's")
	}
}
