package rooms

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/pdrouter/pdrouter/kvtransfer"
	"github.com/pdrouter/pdrouter/kvtransfer/wire"
	"github.com/pdrouter/pdrouter/testkit/kvtest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const (
	testPages   = 64
	testItem    = 256
	testAuxItem = 16
	testAux     = 8
)

// testMem: 2 layers × (K, V) + one aux buffer in one memfd the "engine"
// allocated and registered, each page of each buffer filled with a byte
// pattern unique to (buffer, page) when fill is set.
type testMem struct {
	bufs   [][]byte // 4 KV buffers, then aux
	layout Layout
}

func newTestMem(t testing.TB, s *kvtransfer.MemorySession, fill byte) *testMem {
	t.Helper()
	seg := kvtest.EngineMemory(t, 4*testPages*testItem+testAux*testAuxItem)
	base := kvtest.Addr(seg.Mem)
	if err := s.Register(wire.MemHost, base, uint64(len(seg.Mem)), kvtest.Dup(t, seg.Fd())); err != nil {
		t.Fatal(err)
	}
	m := &testMem{layout: Layout{PageSize: 16, Dtype: "bf16"}}
	for b := 0; b < 4; b++ {
		off := b * testPages * testItem
		mem := seg.Mem[off : off+testPages*testItem]
		if fill != 0 {
			for i := range mem {
				mem[i] = fill + byte(b*31) + byte(i/testItem)*7 + byte(i)
			}
		}
		m.bufs = append(m.bufs, mem)
		m.layout.Bufs = append(m.layout.Bufs, wire.RoomBuf{Kind: wire.KindKV, Addr: base + uint64(off), ItemLen: testItem, Items: testPages})
	}
	off := 4 * testPages * testItem
	aux := seg.Mem[off : off+testAux*testAuxItem]
	if fill != 0 {
		for i := range aux {
			aux[i] = fill ^ byte(i)
		}
	}
	m.bufs = append(m.bufs, aux)
	m.layout.Bufs = append(m.layout.Bufs, wire.RoomBuf{Kind: wire.KindAux, Addr: base + uint64(off), ItemLen: testAuxItem, Items: testAux})
	return m
}

// side is one kvproxy with its engine: a memory plane, rooms on it, and
// the engine's session holding its registered memory and layout.
type side struct {
	R    *Rooms
	P    *kvtransfer.MemoryPlane
	S    *kvtransfer.MemorySession
	T    kvtransfer.Transport
	Mem  *testMem
	Addr string // peer address

	once sync.Once
	err  error
}

// close takes the side down as kvproxy does: rooms, the engine's session,
// the plane, the transport.
func (sd *side) close() error {
	sd.once.Do(func() {
		sd.err = errors.Join(sd.R.Close(), sd.S.Close(), sd.P.Close(), sd.T.Close())
	})
	return sd.err
}

// newSide starts a kvproxy listening on ln (nil: a fresh port) with a
// registered engine pool filled with fill.
func newSide(t testing.TB, name, transport string, ln net.Listener, fill byte, cfg Config) *side {
	t.Helper()
	if ln == nil {
		var err error
		if ln, err = net.Listen("tcp", "127.0.0.1:0"); err != nil {
			t.Fatal(err)
		}
	}
	tr := newTransport(t, transport)
	p, err := kvtransfer.NewMemoryPlane(kvtransfer.MemoryConfig{Name: name, Transport: tr, Listener: ln})
	if err != nil {
		t.Fatal(err)
	}
	cfg.Memory = p
	if cfg.Heartbeat == 0 {
		cfg.Heartbeat = 500 * time.Millisecond
	}
	r, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	sd := &side{R: r, P: p, S: p.NewSession(), T: tr, Addr: ln.Addr().String()}
	t.Cleanup(func() { _ = sd.close() })
	sd.Mem = newTestMem(t, sd.S, fill)
	if err := r.SetLayout(sd.S, sd.Mem.layout); err != nil {
		t.Fatal(err)
	}
	return sd
}

type pair struct {
	P, D         *Rooms
	PS, DS       *side
	PPool, DPool *testMem
}

func newTransport(t testing.TB, name string) kvtransfer.Transport {
	return kvtest.Start(t, name, transports)
}

// transports lists the transports built in (ucx with cgo).
var transports = map[string]func() (kvtransfer.Transport, error){
	"tcp": func() (kvtransfer.Transport, error) { return &kvtransfer.TCP{}, nil },
	"shm": func() (kvtransfer.Transport, error) { return &kvtransfer.SHM{}, nil },
}

// newPair starts a prefill and a decode kvproxy; the decode resolves
// bootstrap address "boot:1" to the prefill.
func newPair(t testing.TB, transport string, tweak func(*Config)) *pair {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	cfgP := Config{}
	cfgD := Config{Resolve: func(_ context.Context, boot string) (string, error) {
		if boot != "boot:1" {
			return "", fmt.Errorf("no bootstrap server at %s", boot)
		}
		return ln.Addr().String(), nil
	}}
	if tweak != nil {
		tweak(&cfgP)
		tweak(&cfgD)
	}
	ps := newSide(t, "P", transport, ln, 1, cfgP)
	ds := newSide(t, "D", transport, nil, 0, cfgD)
	return &pair{P: ps.R, D: ds.R, PS: ps, DS: ds, PPool: ps.Mem, DPool: ds.Mem}
}

func wait(t testing.TB, e *Rooms, room uint64, want State) Status {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	st, err := e.Wait(ctx, room)
	if err != nil {
		t.Fatalf("room %d: %v", room, err)
	}
	if st.State != want {
		t.Fatalf("room %d: state %v (%s), want %v", room, st.State, st.Reason, want)
	}
	return st
}

func eventually(t testing.TB, what string, f func() bool) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		if f() {
			return
		}
	}
	t.Fatalf("timed out waiting for %s", what)
}

func noRooms(t testing.TB, pr *pair) {
	t.Helper()
	eventually(t, "rooms freed", func() bool { return pr.P.ActiveRooms() == 0 && pr.D.ActiveRooms() == 0 })
}

// samePages asserts every KV buffer's src page landed in the dst page.
func samePages(t testing.TB, pr *pair, src, dst []uint32) {
	t.Helper()
	for i := range src {
		for b := 0; b < 4; b++ {
			s := pr.PPool.bufs[b][int(src[i])*testItem:][:testItem]
			d := pr.DPool.bufs[b][int(dst[i])*testItem:][:testItem]
			if !bytes.Equal(s, d) {
				t.Fatalf("buffer %d: src page %d != dst page %d", b, src[i], dst[i])
			}
		}
	}
}

func TestTransfer(t *testing.T) { testTransfer(t, "tcp") }

func testTransfer(t *testing.T, transport string) {
	for _, order := range []string{"expect-first", "send-first"} {
		t.Run(order, func(t *testing.T) {
			pr := newPair(t, transport, nil)
			const room = 1<<63 - 5
			src := []uint32{3, 4, 5, 9, 10, 20, 40, 41, 42, 43}
			dst := []uint32{7, 8, 9, 10, 11, 30, 50, 51, 52, 0}
			send := func() {
				for i, c := range [][]uint32{src[:4], src[4:5], src[5:]} {
					if err := pr.P.Send(room, c, i == 2, 2); err != nil {
						t.Fatal(err)
					}
				}
			}
			if order == "send-first" {
				send()
				if st, _ := pr.P.Poll(room); st.State != Bootstrapping {
					t.Fatalf("prefill room before XFER_REQ: %v", st.State)
				}
			}
			if err := pr.D.Expect(room, "boot:1", dst, 5); err != nil {
				t.Fatal(err)
			}
			if order == "expect-first" {
				eventually(t, "WaitingForInput", func() bool {
					st, err := pr.P.Poll(room)
					return err == nil && st.State == WaitingForInput
				})
				send()
			}
			ds := wait(t, pr.D, room, Success)
			ps := wait(t, pr.P, room, Success)
			samePages(t, pr, src, dst)
			aux := pr.DPool.bufs[4][5*testAuxItem:][:testAuxItem]
			if !bytes.Equal(aux, pr.PPool.bufs[4][2*testAuxItem:][:testAuxItem]) {
				t.Fatal("aux slot not copied")
			}
			wantBytes := uint64(len(src)*4*testItem + testAuxItem)
			if ds.Pages != uint64(len(src)) || ds.Bytes != wantBytes || ps.Bytes != wantBytes {
				t.Fatalf("decode %+v prefill %+v, want %d pages %d bytes", ds, ps, len(src), wantBytes)
			}
			if ds.Transfer <= 0 {
				t.Fatal("no transfer time reported")
			}
			noRooms(t, pr)
			if err := pr.P.Send(room, nil, true, -1); !errors.Is(err, ErrRoomDone) {
				t.Fatalf("Send to a finished room: %v", err)
			}
		})
	}
}

func TestManyRoomsConcurrently(t *testing.T) {
	pr := newPair(t, "tcp", nil)
	const n = 32
	for i := uint64(0); i < n; i++ {
		pages := []uint32{uint32(2 * i), uint32(2*i + 1)}
		if err := pr.D.Expect(100+i, "boot:1", pages, -1); err != nil {
			t.Fatal(err)
		}
		if err := pr.P.Send(100+i, pages, true, -1); err != nil {
			t.Fatal(err)
		}
	}
	for i := uint64(0); i < n; i++ {
		wait(t, pr.D, 100+i, Success)
	}
	if pr.D.Peers() != 1 {
		t.Fatalf("%d peers; one connection per peer pair expected", pr.D.Peers())
	}
	noRooms(t, pr)
}

func TestEmptyTransfer(t *testing.T) {
	pr := newPair(t, "tcp", nil)
	if err := pr.D.Expect(1, "boot:1", nil, -1); err != nil {
		t.Fatal(err)
	}
	if err := pr.P.Send(1, nil, true, -1); err != nil {
		t.Fatal(err)
	}
	if st := wait(t, pr.D, 1, Success); st.Bytes != 0 {
		t.Fatalf("empty transfer moved %d bytes", st.Bytes)
	}
}

func TestPrefillOnlyBootstrapTimeout(t *testing.T) {
	pr := newPair(t, "tcp", func(c *Config) { c.BootstrapTimeout = 150 * time.Millisecond })
	if err := pr.P.Send(7, []uint32{1, 2}, true, -1); err != nil {
		t.Fatal(err)
	}
	st := wait(t, pr.P, 7, Failed)
	if !strings.Contains(st.Reason, "bootstrap timeout") {
		t.Fatalf("reason %q", st.Reason)
	}
	// A late XFER_REQ for the timed-out room is refused, not resurrected.
	if err := pr.D.Expect(7, "boot:1", []uint32{1, 2}, -1); err != nil {
		t.Fatal(err)
	}
	if st := wait(t, pr.D, 7, Failed); !strings.Contains(st.Reason, "already finished") {
		t.Fatalf("late XFER_REQ: %q", st.Reason)
	}
	noRooms(t, pr)
}

func TestDecodeOnlyWaitingTimeout(t *testing.T) {
	pr := newPair(t, "tcp", func(c *Config) { c.WaitingTimeout = 200 * time.Millisecond })
	start := time.Now()
	if err := pr.D.Expect(8, "boot:1", []uint32{1}, -1); err != nil {
		t.Fatal(err)
	}
	st := wait(t, pr.D, 8, Failed)
	if !strings.Contains(st.Reason, "waiting timeout") || time.Since(start) < 200*time.Millisecond {
		t.Fatalf("reason %q after %v", st.Reason, time.Since(start))
	}
	noRooms(t, pr)
}

func TestAbortBothWays(t *testing.T) {
	pr := newPair(t, "tcp", nil)
	// Decode aborts (client went away): prefill's room fails too.
	if err := pr.D.Expect(1, "boot:1", []uint32{1}, -1); err != nil {
		t.Fatal(err)
	}
	eventually(t, "prefill room", func() bool { _, err := pr.P.Poll(1); return err == nil })
	if err := pr.D.Abort(1, "client disconnected"); err != nil {
		t.Fatal(err)
	}
	if st := wait(t, pr.P, 1, Failed); !strings.Contains(st.Reason, "client disconnected") {
		t.Fatalf("prefill reason %q", st.Reason)
	}
	// Prefill aborts mid-room: decode's room fails.
	if err := pr.P.Send(2, []uint32{1}, false, -1); err != nil {
		t.Fatal(err)
	}
	if err := pr.D.Expect(2, "boot:1", []uint32{1, 2}, -1); err != nil {
		t.Fatal(err)
	}
	eventually(t, "first chunk", func() bool { st, _ := pr.D.Poll(2); return st.State == Transferring })
	if err := pr.P.Abort(2, "prefill OOM"); err != nil {
		t.Fatal(err)
	}
	if st := wait(t, pr.D, 2, Failed); !strings.Contains(st.Reason, "prefill OOM") {
		t.Fatalf("decode reason %q", st.Reason)
	}
	noRooms(t, pr)
}

func TestPageCountMismatchFails(t *testing.T) {
	pr := newPair(t, "tcp", nil)
	if err := pr.D.Expect(3, "boot:1", []uint32{1, 2, 3}, -1); err != nil {
		t.Fatal(err)
	}
	if err := pr.P.Send(3, []uint32{1, 2}, true, -1); err != nil {
		t.Fatal(err)
	}
	wait(t, pr.P, 3, Failed)
	wait(t, pr.D, 3, Failed)
}

func TestBadInputs(t *testing.T) {
	pr := newPair(t, "tcp", nil)
	if err := pr.D.Expect(1, "boot:1", []uint32{testPages}, -1); err == nil {
		t.Fatal("page out of range accepted")
	}
	if err := pr.P.Send(1, []uint32{1}, true, testAux); err == nil {
		t.Fatal("aux slot out of range accepted")
	}
	if err := pr.D.Expect(2, "nowhere:1", []uint32{1}, -1); err != nil {
		t.Fatal(err)
	}
	if st := wait(t, pr.D, 2, Failed); !strings.Contains(st.Reason, "no bootstrap server") {
		t.Fatalf("reason %q", st.Reason)
	}
	if err := pr.D.Expect(3, "boot:1", nil, -1); err != nil {
		t.Fatal(err)
	}
	if err := pr.D.Expect(3, "boot:1", nil, -1); !errors.Is(err, ErrRoomExists) {
		t.Fatalf("duplicate Expect: %v", err)
	}
	if _, err := pr.D.Poll(99); !errors.Is(err, ErrUnknownRoom) {
		t.Fatalf("Poll unknown: %v", err)
	}
	// Rooms before the engine described its layout.
	bare, err := New(Config{Memory: pr.DS.P})
	if err == nil {
		t.Fatal("a second room layer on one memory plane")
	}
	_ = pr.D.Close()
	if bare, err = New(Config{Memory: pr.DS.P}); err != nil {
		t.Fatal(err)
	}
	defer bare.Close()
	if err := bare.Send(1, []uint32{1}, true, -1); !errors.Is(err, ErrNoLayout) {
		t.Fatalf("Send without a layout: %v", err)
	}
	// A layout whose engine left with its memory is none.
	if err := bare.SetLayout(pr.DS.S, pr.DPool.layout); err != nil {
		t.Fatal(err)
	}
	_ = pr.DS.S.Close()
	if err := bare.Send(2, []uint32{1}, true, -1); !errors.Is(err, ErrNoLayout) {
		t.Fatalf("Send after the engine left: %v", err)
	}
}

func TestSilentPeerFailsRoomsWithinTwoHeartbeats(t *testing.T) {
	addr, stop := kvtest.SilentPeer(t, false)
	defer stop()
	const hb = 100 * time.Millisecond
	d := newSide(t, "D", "tcp", nil, 0, Config{Heartbeat: hb,
		Resolve: func(context.Context, string) (string, error) { return addr, nil }})
	e := d.R
	start := time.Now()
	for i := uint64(1); i <= 3; i++ {
		if err := e.Expect(i, "x", []uint32{uint32(i)}, -1); err != nil {
			t.Fatal(err)
		}
	}
	for i := uint64(1); i <= 3; i++ {
		st := wait(t, e, i, Failed)
		if !strings.Contains(st.Reason, "peer lost") || !strings.Contains(st.Reason, "silent") {
			t.Fatalf("reason %q", st.Reason)
		}
	}
	if d := time.Since(start); d > 3*hb+150*time.Millisecond {
		t.Fatalf("rooms failed after %v, want within two heartbeats of silence", d)
	}
	if e.ActiveRooms() != 0 || e.Peers() != 0 || d.P.Links() != 0 {
		t.Fatalf("%d rooms, %d room links, %d links left", e.ActiveRooms(), e.Peers(), d.P.Links())
	}
}

// onlyLink is e's one room link.
func onlyLink(e *Rooms) *roomLink {
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, rl := range e.links {
		return rl
	}
	return nil
}

// xferReq is the XFER_REQ pr's decode sends for pages.
func xferReq(pr *pair, room uint64, pages []uint32) *wire.XferReq {
	l := pr.DPool.layout
	return &wire.XferReq{Room: room, AuxSlot: -1, PageSize: l.PageSize, Dtype: l.Dtype, Bufs: l.Bufs, DstPages: pages}
}

func TestMalformedFrameClosesOnlyThatPeer(t *testing.T) {
	pr := newPair(t, "tcp", nil)
	// A second, broken decode peer says MEM_HELLO then sends garbage.
	nc, err := net.Dial("tcp", pr.PS.Addr)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	c := wire.NewConn(nc)
	if err := c.Write(&wire.MemHello{Name: "broken", Transport: "tcp", ListenAddr: "broken:1"}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Read(); err != nil {
		t.Fatal(err)
	}
	// A healthy room through the real decode peer, in flight meanwhile.
	if err := pr.D.Expect(5, "boot:1", []uint32{1}, -1); err != nil {
		t.Fatal(err)
	}
	eventually(t, "two links", func() bool { return pr.PS.P.Links() == 2 && pr.P.Peers() == 1 })
	if _, err := nc.Write([]byte("KV\x02\x09garbage")); err != nil {
		t.Fatal(err)
	}
	eventually(t, "broken peer closed", func() bool { return pr.PS.P.Links() == 1 })
	if err := pr.P.Send(5, []uint32{1}, true, -1); err != nil {
		t.Fatal(err)
	}
	wait(t, pr.D, 5, Success)
	_ = nc.SetReadDeadline(time.Now().Add(2 * time.Second))
	for {
		if _, err := c.Read(); err != nil {
			break // closed by P
		}
	}
}

// TestBadXferReqAborted: an XFER_REQ whose layout does not pair with the
// prefill's, or whose pages lie outside it, is answered with ABORT and
// never moves a byte.
func TestBadXferReqAborted(t *testing.T) {
	pr := newPair(t, "tcp", nil)
	if err := pr.D.Expect(1, "boot:1", []uint32{0}, -1); err != nil {
		t.Fatal(err)
	}
	eventually(t, "P's room link", func() bool { return pr.P.Peers() == 1 })
	rl := onlyLink(pr.P)
	for name, m := range map[string]*wire.XferReq{
		"page size": func() *wire.XferReq { m := xferReq(pr, 10, []uint32{1}); m.PageSize = 32; return m }(),
		"dtype":     func() *wire.XferReq { m := xferReq(pr, 11, []uint32{1}); m.Dtype = "fp8"; return m }(),
		"buffers":   func() *wire.XferReq { m := xferReq(pr, 12, []uint32{1}); m.Bufs = m.Bufs[1:]; return m }(),
		"item": func() *wire.XferReq {
			m := xferReq(pr, 13, []uint32{1})
			m.Bufs = slices.Clone(m.Bufs)
			m.Bufs[0].ItemLen *= 2
			return m
		}(),
		"page": xferReq(pr, 14, []uint32{testPages}),
	} {
		pr.P.onXferReq(rl, m)
		if _, err := pr.P.Poll(m.Room); !errors.Is(err, ErrUnknownRoom) {
			t.Errorf("%s: a bad XFER_REQ opened room %d: %v", name, m.Room, err)
		}
	}
	if err := pr.P.Send(1, []uint32{3}, true, -1); err != nil {
		t.Fatal(err)
	}
	wait(t, pr.D, 1, Success)
}

func TestCloseFailsRooms(t *testing.T) {
	pr := newPair(t, "tcp", nil)
	if err := pr.P.Send(9, []uint32{1}, true, -1); err != nil {
		t.Fatal(err)
	}
	if err := pr.P.Close(); err != nil {
		t.Fatal(err)
	}
	if st, err := pr.P.Poll(9); err != nil || st.State != Failed {
		t.Fatalf("after Close: %+v %v", st, err)
	}
	if err := pr.P.Send(10, nil, true, -1); !errors.Is(err, kvtransfer.ErrClosed) {
		t.Fatalf("Send after Close: %v", err)
	}
}

// TestRoomMatchedOverAClosedPeerFails: an XFER_REQ read just before the
// link's sender or heartbeat closed it is matched after that link's
// rooms were failed; the room must fail then too, not wait out the
// waiting timeout over a connection that is gone.
func TestRoomMatchedOverAClosedPeerFails(t *testing.T) {
	pr := newPair(t, "tcp", nil)
	if err := pr.D.Expect(1, "boot:1", []uint32{0}, -1); err != nil {
		t.Fatal(err)
	}
	eventually(t, "P's room link", func() bool { return pr.P.Peers() == 1 })
	rl := onlyLink(pr.P)
	rl.l.Close(errors.New("write: connection reset"))
	pr.P.onXferReq(rl, xferReq(pr, 2, []uint32{1}))
	if st, err := pr.P.Poll(2); err != nil || st.State != Failed {
		t.Fatalf("room matched over a closed peer: %+v %v, want Failed", st, err)
	}
	wait(t, pr.D, 1, Failed)
}

func TestTransferSHM(t *testing.T) { testTransfer(t, "shm") }

// TestDataFramesProveAPeerAlive: a peer busy streaming DATA frames sends no
// heartbeat meanwhile (its frames queue behind the stream); its rooms must
// live on, and fail only once it sends nothing at all.
func TestDataFramesProveAPeerAlive(t *testing.T) {
	quiet := make(chan struct{})
	addr, stop := kvtest.Peer(t, &wire.MemHello{Name: "busy", Transport: "tcp"}, func(c *wire.Conn, quit <-chan struct{}) {
		go kvtest.Drain(c) // what the decode sends
		for end := time.Now().Add(1500 * time.Millisecond); time.Now().Before(end); time.Sleep(10 * time.Millisecond) {
			// For a region the decode does not have: read and dropped.
			if c.WriteData(99, 0, make([]byte, 4096)) != nil {
				return
			}
		}
		close(quiet)
		select {
		case <-time.After(3 * time.Second):
		case <-quit:
		}
	})
	t.Cleanup(stop)
	const hb = 250 * time.Millisecond
	d := newSide(t, "D", "tcp", nil, 0, Config{Heartbeat: hb,
		Resolve: func(context.Context, string) (string, error) { return addr, nil }})
	if err := d.R.Expect(1, "x", []uint32{1}, -1); err != nil {
		t.Fatal(err)
	}
	<-quiet
	if st, err := d.R.Poll(1); err != nil || st.State.Terminal() {
		t.Fatalf("room over a link busy with DATA frames: %+v %v, want it alive", st, err)
	}
	st := wait(t, d.R, 1, Failed)
	if !strings.Contains(st.Reason, "silent") {
		t.Fatalf("reason %q", st.Reason)
	}
}

// Peers counts the links rooms have used that are still open.
func (e *Rooms) Peers() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return len(e.links)
}
