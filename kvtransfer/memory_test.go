package kvtransfer

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/pdrouter/pdrouter/kvtransfer/wire"
	"github.com/pdrouter/pdrouter/testkit/kvtest"
)

// engineMemory is memory an engine owns (kvtest.EngineMemory) and a
// function that returns an fd of it for each registration to take.
func engineMemory(t testing.TB, size int) ([]byte, func() int) {
	seg := kvtest.EngineMemory(t, size)
	return seg.Mem, func() int { return kvtest.Dup(t, seg.Fd()) }
}

var addrOf = kvtest.Addr

type memSide struct {
	p   *MemoryPlane
	s   *MemorySession
	tr  Transport
	reg *prometheus.Registry
}

func newMemSide(t testing.TB, transport string, timeout time.Duration, opts ...func(*MemoryConfig)) *memSide {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	tr := newTransport(t, transport)
	reg := prometheus.NewRegistry()
	cfg := MemoryConfig{Name: "m", Transport: tr, Listener: ln, WriteTimeout: timeout, Registry: reg}
	for _, o := range opts {
		o(&cfg)
	}
	p, err := NewMemoryPlane(cfg)
	if err != nil {
		t.Fatal(err)
	}
	m := &memSide{p: p, s: p.NewSession(), tr: tr, reg: reg}
	t.Cleanup(func() {
		if err := m.p.Close(); err != nil {
			t.Error(err)
		}
		if err := m.tr.Close(); err != nil {
			t.Error(err)
		}
	})
	return m
}

// newMemPair is two kvproxies, each with an engine that registered size
// bytes: src on a, filled from seed (0: left zero), and dst on b.
func newMemPair(t testing.TB, transport string, timeout time.Duration, size int, seed byte, opts ...func(*MemoryConfig)) (a, b *memSide, src, dst []byte) {
	t.Helper()
	a, b = newMemSide(t, transport, timeout, opts...), newMemSide(t, transport, timeout, opts...)
	src, dst = a.memory(t, size), b.memory(t, size)
	if seed != 0 {
		fill(src, seed)
	}
	return a, b, src, dst
}

// memory is size bytes of engine memory registered on m.
func (m *memSide) memory(t testing.TB, size int) []byte {
	t.Helper()
	mem, dup := engineMemory(t, size)
	m.register(t, mem, dup)
	return mem
}

func (m *memSide) register(t testing.TB, mem []byte, dup func() int) {
	t.Helper()
	if err := m.s.Register(wire.MemHost, addrOf(mem), uint64(len(mem)), dup()); err != nil {
		t.Fatal(err)
	}
}

// gauge reads kvproxy_registered_regions as /metrics would show it.
func (m *memSide) gauge() float64 {
	mfs, err := m.reg.Gather()
	if err != nil {
		panic(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == "kvproxy_registered_regions" {
			return mf.GetMetric()[0].GetGauge().GetValue()
		}
	}
	return -1
}

// metric reads an unlabelled gauge or counter of m's registry; one not
// exported fails the test.
func (m *memSide) metric(t testing.TB, name string) float64 {
	t.Helper()
	mfs, err := m.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name && len(mf.GetMetric()) == 1 {
			if g := mf.GetMetric()[0].GetGauge(); g != nil {
				return g.GetValue()
			}
			return mf.GetMetric()[0].GetCounter().GetValue()
		}
	}
	t.Fatalf("%s is not exported", name)
	return 0
}

const page = 4096

func fill(b []byte, seed byte) {
	for i := range b {
		b[i] = byte(i*7) + seed
	}
}

func init() {
	transports["shm"] = func() (Transport, error) { return &SHM{}, nil }
}

// memoryTransports: ucx without an rc or dc lane moves host memory by DATA
// frames; puts: by its own puts anyway (MemoryConfig.TransportPuts).
func memoryTransports() []struct {
	name, tls string
	puts      bool
} {
	return []struct {
		name, tls string
		puts      bool
	}{{"tcp", "", false}, {"shm", "", false}, {"ucx", "tcp", false}, {"ucx", "tcp", true}, {"ucx", "posix,cma,tcp", false}, {"ucx", "posix,cma,tcp", true}}
}

func withPuts(puts bool) func(*MemoryConfig) { return func(c *MemoryConfig) { c.TransportPuts = puts } }

// A plane without a transport or a listener is refused, not started.
func TestNewMemoryPlaneNeedsTransportAndListener(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	for _, cfg := range []MemoryConfig{{Listener: ln}, {Transport: &TCP{}}} {
		if p, err := NewMemoryPlane(cfg); err == nil {
			p.Close()
			t.Fatalf("NewMemoryPlane(%+v) started a plane", cfg)
		}
	}
}

func TestMemoryWrite(t *testing.T) {
	for _, tc := range memoryTransports() {
		t.Run(fmt.Sprintf("%s/%s/puts=%t", tc.name, tc.tls, tc.puts), func(t *testing.T) {
			if tc.tls != "" {
				t.Setenv("UCX_TLS", tc.tls)
			}
			a, b, src, dst := newMemPair(t, tc.name, 5*time.Second, 64*page, 1, withPuts(tc.puts))
			if want := map[bool]Path{false: PathTCP, true: PathUCX}[tc.puts]; tc.name == "ucx" && a.p.hostPath != want {
				t.Fatalf("host path %q, want %q", a.p.hostPath, want)
			}
			ctx := context.Background()
			// Pages 0..7 to 10..17 (one merged run), then scattered pages.
			var ts []Triple
			for i := range 8 {
				ts = append(ts, Triple{Src: addrOf(src) + uint64(i*page), Dst: addrOf(dst) + uint64((10+i)*page), Len: page})
			}
			ts = append(ts, Triple{Src: addrOf(src) + 40*page, Dst: addrOf(dst) + 2*page, Len: 100},
				Triple{Src: addrOf(src) + 30*page, Dst: addrOf(dst) + 50*page, Len: 3 * page})
			if err := a.s.Write(ctx, b.p.PeerAddr(), ts); err != nil {
				t.Fatal(err)
			}
			for i, tr := range ts {
				got := dst[tr.Dst-addrOf(dst):][:tr.Len]
				if !bytes.Equal(got, src[tr.Src-addrOf(src):][:tr.Len]) {
					t.Fatalf("triple %d did not land", i)
				}
			}
			if dst[0] != 0 || dst[9*page] != 0 {
				t.Fatal("bytes outside the triples changed")
			}
			// Memory registered after the link came up: found by a refresh.
			late := b.memory(t, 4*page)
			if err := a.s.Write(ctx, b.p.PeerAddr(), []Triple{{Src: addrOf(src) + 5*page, Dst: addrOf(late), Len: 4 * page}}); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(late, src[5*page:9*page]) {
				t.Fatal("write into late registration did not land")
			}
			if a.p.Links() != 1 || b.p.Links() != 1 {
				t.Fatalf("links %d %d, want one each", a.p.Links(), b.p.Links())
			}
			if g := b.gauge(); g != 2 {
				t.Fatalf("registered regions gauge %v, want 2", g)
			}
		})
	}
}

func TestMemoryWriteMergesRuns(t *testing.T) {
	a, b, src, dst := newMemPair(t, "tcp", 5*time.Second, 16*page, 0)
	ctx := context.Background()
	l, err := a.p.link(ctx, b.p.PeerAddr())
	if err != nil {
		t.Fatal(err)
	}
	var ts []Triple
	for i := range 4 { // contiguous on both sides
		ts = append(ts, Triple{Src: addrOf(src) + uint64(i*page), Dst: addrOf(dst) + uint64(i*page), Len: page})
	}
	ts = append(ts, Triple{Src: addrOf(src) + 4*page, Dst: addrOf(dst) + 8*page, Len: page}) // dst jumps
	ts = append(ts, Triple{Src: addrOf(src) + 5*page, Dst: addrOf(dst) + 9*page, Len: page}) // continues that
	ts = append(ts, Triple{Src: addrOf(src) + 7*page, Dst: addrOf(dst) + 10*page, Len: 0})   // empty: skipped
	runs, srcs, err := a.p.resolve(ctx, l, ts)
	for _, r := range srcs {
		r.use.RUnlock()
	}
	if err != nil {
		t.Fatal(err)
	}
	if len(runs) != 2 || runs[0].size != 4*page || runs[1].size != 2*page || runs[1].dstOff != 8*page {
		t.Fatalf("runs %+v, want [4 pages at 0, 2 pages at 8]", runs)
	}
}

func TestMemoryWriteRejectsUnregistered(t *testing.T) {
	a, b, src, dst := newMemPair(t, "tcp", 2*time.Second, 8*page, 3)
	ctx := context.Background()
	peer := b.p.PeerAddr()
	good := Triple{Src: addrOf(src), Dst: addrOf(dst), Len: page}
	for name, bad := range map[string]Triple{
		"source outside":          {Src: addrOf(src) + 8*page, Dst: addrOf(dst), Len: page},
		"source past the end":     {Src: addrOf(src) + 7*page, Dst: addrOf(dst), Len: 2 * page},
		"destination outside":     {Src: addrOf(src), Dst: addrOf(dst) + 8*page, Len: page},
		"destination past end":    {Src: addrOf(src), Dst: addrOf(dst) + 7*page + 1, Len: page},
		"source wraps the space":  {Src: 1<<64 - page, Dst: addrOf(dst), Len: 2 * page},
		"destination wraps space": {Src: addrOf(src), Dst: 1<<64 - page, Len: 2 * page},
	} {
		err := a.s.Write(ctx, peer, []Triple{good, bad})
		if !errors.Is(err, ErrNotRegistered) {
			t.Errorf("%s: %v, want ErrNotRegistered", name, err)
		}
	}
	if dst[0] != 0 {
		t.Fatal("a rejected write moved bytes")
	}
	// The peer drops its region: its push makes the next write fail.
	if err := b.s.Unregister(addrOf(dst) + 5); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(2 * time.Second)
	for {
		err := a.s.Write(ctx, peer, []Triple{good})
		if errors.Is(err, ErrNotRegistered) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("write into an unregistered peer region: %v", err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err := b.s.Unregister(addrOf(dst)); !errors.Is(err, ErrNotRegistered) {
		t.Fatalf("second unregister: %v", err)
	}
	if b.gauge() != 0 || b.p.Mappings() != 0 {
		t.Fatalf("after unregister: gauge %v, mappings %d", b.gauge(), b.p.Mappings())
	}
}

func TestMemoryRegisterChecks(t *testing.T) {
	a := newMemSide(t, "tcp", time.Second)
	mem, dup := engineMemory(t, 4*page)
	base := addrOf(mem)
	cases := []struct {
		name       string
		kind       wire.MemKind
		addr, size uint64
		fd         int
		want       string
	}{
		{"cuda", wire.MemCUDA, base, page, -1, "not supported in this build"},
		{"unknown kind", 7, base, page, -1, "unknown kind"},
		{"no fd", wire.MemHost, base, page, -1, "no memfd"},
		{"unaligned", wire.MemHost, base + 1, page, dup(), "page-aligned"},
		{"empty", wire.MemHost, base, 0, dup(), "bad range"},
		{"longer than the memfd", wire.MemHost, base, 8 * page, dup(), "memfd holds"},
	}
	for _, c := range cases {
		if err := a.s.Register(c.kind, c.addr, c.size, c.fd); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want %q", c.name, err, c.want)
		}
	}
	a.register(t, mem, dup)
	if err := a.s.Register(wire.MemHost, base+page, page, dup()); err == nil || !strings.Contains(err.Error(), "overlaps") {
		t.Fatalf("overlapping register: %v", err)
	}
	other := a.p.NewSession()
	if err := other.Register(wire.MemHost, base, 4*page, dup()); err == nil || !strings.Contains(err.Error(), "overlaps") {
		t.Fatalf("same range from another session: %v", err)
	}
	if err := other.Unregister(base); !errors.Is(err, ErrNotRegistered) {
		t.Fatalf("unregister of another session's region: %v", err)
	}
	// The same range again replaces the registration (a new memfd).
	a.register(t, mem, dup)
	if a.gauge() != 1 || a.p.Mappings() != 1 {
		t.Fatalf("after re-register: gauge %v, mappings %d", a.gauge(), a.p.Mappings())
	}
	if err := a.s.Close(); err != nil {
		t.Fatal(err)
	}
	if a.gauge() != 0 || a.p.Regions() != 0 {
		t.Fatalf("after session close: gauge %v, regions %d", a.gauge(), a.p.Regions())
	}
}

// TestMemoryDeadPeerBounded: a peer that completes the handshake and then
// never answers, and a peer that went away, both fail writes within the
// write timeout.
func TestMemoryDeadPeerBounded(t *testing.T) {
	const timeout = 700 * time.Millisecond
	a := newMemSide(t, "tcp", timeout)
	src := a.memory(t, 4*page)
	peer, stopPeer := kvtest.SilentPeer(t, false)
	t0 := time.Now()
	err := a.s.Write(context.Background(), peer, []Triple{{Src: addrOf(src), Dst: 1 << 30, Len: page}})
	if err == nil || time.Since(t0) > 3*timeout {
		t.Fatalf("write to a silent peer: %v after %s", err, time.Since(t0))
	}
	stopPeer()
	if a.p.Links() != 0 {
		t.Fatalf("%d links left after the silent peer failed (%v)", a.p.Links(), err)
	}

	b := newMemSide(t, "tcp", timeout)
	dst := b.memory(t, 4*page)
	good := []Triple{{Src: addrOf(src), Dst: addrOf(dst), Len: page}}
	if err := a.s.Write(context.Background(), b.p.PeerAddr(), good); err != nil {
		t.Fatal(err)
	}
	peer = b.p.PeerAddr()
	if err := b.p.Close(); err != nil {
		t.Fatal(err)
	}
	t0 = time.Now()
	if err := a.s.Write(context.Background(), peer, good); err == nil || time.Since(t0) > 3*timeout {
		t.Fatalf("write to a closed peer: %v after %s", err, time.Since(t0))
	}
}

// TestMemorySessionCloseFailsWrites: closing the engine's session fails its
// write in flight promptly and drops its regions.
func TestMemorySessionCloseFailsWrites(t *testing.T) {
	a := newMemSide(t, "tcp", 5*time.Second)
	src := a.memory(t, 4*page)
	peer, stopPeer := kvtest.SilentPeer(t, true)
	defer stopPeer()
	errc := make(chan error, 1)
	go func() {
		errc <- a.s.Write(context.Background(), peer, []Triple{{Src: addrOf(src), Dst: 1 << 30, Len: page}})
	}()
	time.Sleep(100 * time.Millisecond)
	t0 := time.Now()
	if err := a.s.Close(); err != nil {
		t.Fatal(err)
	}
	if err := <-errc; err == nil || !strings.Contains(err.Error(), "engine disconnected") {
		t.Fatalf("write in flight when the session closed: %v", err)
	}
	if time.Since(t0) > time.Second {
		t.Fatalf("session close took %s", time.Since(t0))
	}
	if a.gauge() != 0 || a.p.Mappings() != 0 {
		t.Fatalf("after session close: gauge %v, mappings %d", a.gauge(), a.p.Mappings())
	}
}

// memfdMappings counts this process's mappings of engine memfds.
func memfdMappings(t testing.TB) int {
	b, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		t.Fatal(err)
	}
	return strings.Count(string(b), "/memfd:engine")
}

// TestSHMForgetsDroppedRegions: the shm transport maps the peer engine's
// memfd; once the peer drops that region, the writer's mapping goes too
// (else a departed engine's memory would live as long as the link).
func TestSHMForgetsDroppedRegions(t *testing.T) {
	a, b, src, dst := newMemPair(t, "shm", 2*time.Second, 4*page, 9)
	base := memfdMappings(t) // the engines' two and each kvproxy's one
	if err := a.s.Write(context.Background(), b.p.PeerAddr(), []Triple{{Src: addrOf(src), Dst: addrOf(dst), Len: 4 * page}}); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(dst, src) {
		t.Fatal("shm write did not land")
	}
	if n := memfdMappings(t); n != base+1 {
		t.Fatalf("%d memfd mappings after the write, want %d (+ the writer's view of the peer's)", n, base+1)
	}
	if err := b.s.Unregister(addrOf(dst)); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for memfdMappings(t) != base-1 { // b's own went to quarantine, a's view of it went
		if time.Now().After(deadline) {
			t.Fatalf("%d memfd mappings after the peer dropped its region, want %d", memfdMappings(t), base-1)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestLinkAcceptedAcrossATablePushGetsTheTable: a region dropped after an
// accepted link's MEM_HELLO left but before the link joined the table
// pushes must still reach that peer (CI once saw the writer keep its
// mapping of the dropped region: the push went to no link).
func TestLinkAcceptedAcrossATablePushGetsTheTable(t *testing.T) {
	b := newMemSide(t, "tcp", 2*time.Second)
	dst := b.memory(t, 4*page)
	ours, theirs := net.Pipe()
	defer ours.Close()
	_ = ours.SetDeadline(time.Now().Add(5 * time.Second))
	peer := wire.NewConn(ours)
	// net.Pipe is unbuffered: the peer reads on its own goroutine.
	got := make(chan wire.Msg, 2)
	go func() {
		defer close(got)
		if peer.Write(&wire.MemHello{Name: "writer", Transport: b.tr.Name()}) != nil {
			return
		}
		for range 2 {
			m, err := peer.Read()
			if err != nil {
				return
			}
			got <- m
		}
	}()
	l, err := b.p.handshake(theirs, false)
	if err != nil {
		t.Fatal(err)
	}
	if h, ok := (<-got).(*wire.MemHello); !ok || len(h.Regions) != 1 {
		t.Fatalf("MEM_HELLO %#v, want one listing the region", h)
	}
	if err := b.s.Unregister(addrOf(dst)); err != nil {
		t.Fatal(err)
	}
	if !b.p.addLink(l, "", false) {
		t.Fatal("addLink refused the link")
	}
	m, ok := <-got
	if !ok {
		t.Fatal("no table after the link joined")
	}
	if regions, ok := m.(*wire.MemRegions); !ok || len(regions.Regions) != 0 {
		t.Fatalf("got %#v, want the table without the dropped region", m)
	}
}

// pipeLink is a link b accepted from a peer the test plays over net.Pipe:
// the test's end, the peer's wire conn on it, and b's link, in b's table.
func pipeLink(t *testing.T, b *memSide) (net.Conn, *wire.Conn, *memLink) {
	t.Helper()
	ours, theirs := net.Pipe()
	peer := wire.NewConn(ours)
	greeted := make(chan error, 1) // net.Pipe is unbuffered: the peer greets on its own goroutine
	go func() {
		err := peer.Write(&wire.MemHello{Name: "peer", Transport: b.tr.Name()})
		if err == nil {
			_, err = peer.Read() // our MEM_HELLO
		}
		greeted <- err
	}()
	l, err := b.p.handshake(theirs, false)
	if err != nil {
		t.Fatal(err)
	}
	if err := <-greeted; err != nil {
		t.Fatal(err)
	}
	if !b.p.addLink(l, "", false) {
		t.Fatal("addLink refused the link")
	}
	return ours, peer, l
}

// TestTableAnswerDoesNotUndoALaterPush: a table push read after the answer
// to our table request is the newer table, and must be the one that stays.
func TestTableAnswerDoesNotUndoALaterPush(t *testing.T) {
	b := newMemSide(t, "tcp", 2*time.Second)
	for i := range 20 {
		ours, peer, l := pipeLink(t, b)
		_ = ours.SetDeadline(time.Now().Add(5 * time.Second))
		refreshed := make(chan error, 1)
		go func() { refreshed <- l.refresh(context.Background()) }()
		m, err := peer.Read()
		req, ok := m.(*wire.MemRegionsReq)
		if err != nil || !ok {
			t.Fatalf("want a table request, got %#v %v", m, err)
		}
		old := []wire.MemRegion{{ID: 1, Kind: wire.MemHost, Base: 1 << 20, Len: page, Addr: 1 << 20}}
		for _, msg := range []wire.Msg{&wire.MemRegions{Seq: req.Seq, Regions: old}, &wire.MemRegions{}, &wire.MemFence{Seq: 99}} {
			if err := peer.Write(msg); err != nil {
				t.Fatal(err)
			}
		}
		if err := <-refreshed; err != nil {
			t.Fatal(err)
		}
		if m, err := peer.Read(); err != nil || m.Type() != (&wire.MemFenceAck{}).Type() { // the reader is past the push
			t.Fatalf("want the fence's ack, got %#v %v", m, err)
		}
		if r, found := l.remoteRegion(1<<20, 1); found {
			t.Fatalf("round %d: the answer's table (region %d) replaced the newer push", i, r.ID)
		}
		ours.Close()
	}
}

// TestTableAnswerNeverListsADroppedRegion: an answer to a table request
// whose table was taken before a region's drop must not reach the peer
// after the push that dropped it (the peer installs tables in link order,
// so it would believe in the region again). Regions roll over, one new
// before each drop, while the peer asks for the table nonstop; a push
// listing region n means every region below n is gone for good.
func TestTableAnswerNeverListsADroppedRegion(t *testing.T) {
	b := newMemSide(t, "tcp", 5*time.Second)
	ours, peer, _ := pipeLink(t, b)
	defer ours.Close()
	stop := make(chan struct{})
	asked := make(chan struct{})
	go func() { // ask until the test ends (the pipe closes)
		defer close(asked)
		for seq := uint64(1); ; seq++ {
			select {
			case <-stop:
				return
			default:
			}
			if peer.Write(&wire.MemRegionsReq{Seq: seq}) != nil {
				return
			}
		}
	}()
	violation := make(chan string, 1)
	read := make(chan struct{})
	go func() {
		defer close(read)
		var goneBelow uint32
		for {
			m, err := peer.Read()
			if err != nil {
				return
			}
			regions, ok := m.(*wire.MemRegions)
			if !ok {
				continue
			}
			for _, r := range regions.Regions {
				if r.ID < goneBelow {
					select {
					case violation <- fmt.Sprintf("table (seq %d) lists region %d after a push showed every region below %d gone", regions.Seq, r.ID, goneBelow):
					default:
					}
				}
			}
			if regions.Seq == 0 && len(regions.Regions) > 0 {
				low := regions.Regions[0].ID
				for _, r := range regions.Regions {
					low = min(low, r.ID)
				}
				goneBelow = max(goneBelow, low)
			}
		}
	}()
	bufs := [2][]byte{}
	dups := [2]func() int{}
	for i := range bufs {
		bufs[i], dups[i] = engineMemory(t, page)
	}
	b.register(t, bufs[0], dups[0])
	for i := 1; i <= 1000; i++ {
		b.register(t, bufs[i%2], dups[i%2])
		if err := b.s.Unregister(addrOf(bufs[(i-1)%2])); err != nil {
			t.Fatal(err)
		}
		select {
		case v := <-violation:
			t.Fatalf("round %d: %s", i, v)
		default:
		}
	}
	close(stop)
	ours.Close()
	<-asked
	<-read
	select {
	case v := <-violation:
		t.Fatal(v)
	default:
	}
}

// gatedSHM is the shm transport pausing after each key unpack, so a test
// can move the peer's table on while a write holds a key not yet cached.
type gatedSHM struct {
	SHM
	unpacked, resume chan struct{}
}

func (g *gatedSHM) MemoryEndpoint(addr []byte) (MemoryEndpoint, error) {
	ep, err := g.SHM.MemoryEndpoint(addr)
	if err != nil {
		return nil, err
	}
	return &gatedEndpoint{MemoryEndpoint: ep, g: g}, nil
}

type gatedEndpoint struct {
	MemoryEndpoint
	g *gatedSHM
}

func (e *gatedEndpoint) Unpack(rkey []byte) (RemoteKey, error) {
	k, err := e.MemoryEndpoint.Unpack(rkey)
	e.g.unpacked <- struct{}{}
	<-e.g.resume
	return k, err
}

// TestKeyUnpackedAcrossATablePushIsNotKept: a write unpacks the key of a
// peer region while the peer's push dropping that region is installed;
// the push found no key to forget, so the write must not cache it (else
// the writer's mapping of the departed engine's memory lives on).
func TestKeyUnpackedAcrossATablePushIsNotKept(t *testing.T) {
	b := newMemSide(t, "shm", 5*time.Second)
	dst := b.memory(t, 4*page)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := &gatedSHM{unpacked: make(chan struct{}), resume: make(chan struct{})}
	a, err := NewMemoryPlane(MemoryConfig{Name: "a", Transport: g, Listener: ln, WriteTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := a.Close(); err != nil {
			t.Error(err)
		}
	}()
	as := a.NewSession()
	src, srcFd := engineMemory(t, 4*page)
	if err := as.Register(wire.MemHost, addrOf(src), uint64(len(src)), srcFd()); err != nil {
		t.Fatal(err)
	}
	base := memfdMappings(t) // the engines' two and each kvproxy's one
	wrote := make(chan error, 1)
	go func() {
		wrote <- as.Write(context.Background(), b.p.PeerAddr(), []Triple{{Src: addrOf(src), Dst: addrOf(dst), Len: 4 * page}})
	}()
	<-g.unpacked // the writer mapped the peer's memfd; the key is not cached yet
	if err := b.s.Unregister(addrOf(dst)); err != nil {
		t.Fatal(err)
	}
	l, err := a.link(context.Background(), b.p.PeerAddr())
	if err != nil {
		t.Fatal(err)
	}
	if err := l.refresh(context.Background()); err != nil { // the push came before this answer
		t.Fatal(err)
	}
	close(g.resume)
	if err := <-wrote; !errors.Is(err, ErrNotRegistered) {
		t.Errorf("write into a region dropped before its bytes moved: %v, want %v", err, ErrNotRegistered)
	}
	l.mu.Lock()
	cached := len(l.keys)
	l.mu.Unlock()
	if cached != 0 {
		t.Errorf("%d keys cached for a peer table without regions", cached)
	}
	if n := memfdMappings(t); n != base-1 { // b's own went to quarantine, a's view of it must go
		t.Errorf("%d memfd mappings after the peer dropped its region, want %d", n, base-1)
	}
}

func TestWriteDeadlineScalesWithBytes(t *testing.T) {
	if d := writeDeadline(5*time.Second, []Triple{{Len: 4096}}); d < 5*time.Second || d > 5*time.Second+time.Millisecond {
		t.Fatalf("small write: %v", d)
	}
	// One SGLang chunk of Llama-3.1-8B KV (8192 tokens, 1 GiB): 16 s more.
	if d := writeDeadline(5*time.Second, []Triple{{Len: 512 << 20}, {Len: 512 << 20}}); d != 21*time.Second {
		t.Fatalf("1 GiB write: %v", d)
	}
	if d := writeDeadline(time.Second, []Triple{{Len: 1<<64 - 1}, {Len: 1<<64 - 1}}); d <= time.Second {
		t.Fatalf("bogus lengths: %v", d)
	}
}
