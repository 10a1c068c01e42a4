package kvtransfer

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/pdrouter/pdrouter/kvtransfer/wire"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const (
	testPages   = 64
	testItem    = 256
	testAuxItem = 16
	testAux     = 8
)

// testPool: 2 layers × (K, V) + one aux buffer, each page of each buffer
// filled with a byte pattern unique to (buffer, page) when fill is set.
// The transport allocates the memory, as kvproxy has it do.
func testPool(t testing.TB, tr Transport, fill byte) *Pool {
	seg, err := tr.Alloc(4*testPages*testItem + testAux*testAuxItem)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = seg.Close() })
	all := seg.Mem
	p := &Pool{PageSize: 16, Dtype: "bf16"}
	for b := 0; b < 4; b++ {
		mem := all[b*testPages*testItem : (b+1)*testPages*testItem]
		if fill != 0 {
			for i := range mem {
				mem[i] = fill + byte(b*31) + byte(i/testItem)*7 + byte(i)
			}
		}
		p.Regions = append(p.Regions, Region{Kind: wire.KindKV, ItemLen: testItem, Mem: mem})
	}
	aux := all[4*testPages*testItem:][:testAux*testAuxItem] // UCX may round the segment up
	if fill != 0 {
		for i := range aux {
			aux[i] = fill ^ byte(i)
		}
	}
	p.Regions = append(p.Regions, Region{Kind: wire.KindAux, ItemLen: testAuxItem, Mem: aux})
	return p
}

type pair struct {
	P, D         *Engine
	PPool, DPool *Pool
}

func newTransport(t testing.TB, name string) Transport {
	if name == "tcp" {
		return &TCP{}
	}
	f, ok := transports[name]
	if !ok {
		t.Skipf("transport %s not built in", name)
	}
	tr, err := f()
	if err != nil {
		t.Skipf("transport %s: %v", name, err)
	}
	return tr
}

// transports lists the optional transports built in (ucx with cgo).
var transports = map[string]func() (Transport, error){}

func newPair(t testing.TB, transport string, tweak func(*Config)) *pair {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	cfgP := Config{Name: "P", Transport: newTransport(t, transport), Listener: ln, Heartbeat: 500 * time.Millisecond}
	cfgD := Config{Name: "D", Transport: newTransport(t, transport), Heartbeat: 500 * time.Millisecond,
		Resolve: func(_ context.Context, boot string) (string, error) {
			if boot != "boot:1" {
				return "", fmt.Errorf("no bootstrap server at %s", boot)
			}
			return ln.Addr().String(), nil
		}}
	if tweak != nil {
		tweak(&cfgP)
		tweak(&cfgD)
	}
	pr := &pair{PPool: testPool(t, cfgP.Transport, 1), DPool: testPool(t, cfgD.Transport, 0)}
	if pr.P, err = New(cfgP); err != nil {
		t.Fatal(err)
	}
	if pr.D, err = New(cfgD); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = pr.D.Close()
		_ = pr.P.Close()
		_ = cfgP.Transport.Close()
		_ = cfgD.Transport.Close()
	})
	if err := pr.P.RegisterPool(pr.PPool); err != nil {
		t.Fatal(err)
	}
	if err := pr.D.RegisterPool(pr.DPool); err != nil {
		t.Fatal(err)
	}
	return pr
}

func wait(t testing.TB, e *Engine, room uint64, want State) Status {
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

// checkPages asserts every KV buffer's src page landed in the dst page.
func checkPages(t testing.TB, pr *pair, src, dst []uint32) {
	t.Helper()
	for i := range src {
		for b := 0; b < 4; b++ {
			s := pr.PPool.Regions[b].Mem[int(src[i])*testItem:][:testItem]
			d := pr.DPool.Regions[b].Mem[int(dst[i])*testItem:][:testItem]
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
			checkPages(t, pr, src, dst)
			aux := pr.DPool.Regions[4].Mem[5*testAuxItem:][:testAuxItem]
			if !bytes.Equal(aux, pr.PPool.Regions[4].Mem[2*testAuxItem:][:testAuxItem]) {
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

func TestBuildRunsMerges(t *testing.T) {
	p := testPool(t, &TCP{}, 0)
	runs := buildRuns(p, []uint32{1, 2, 3, 7, 8}, []uint32{10, 11, 12, 13, 14})
	// Two merged runs ([1..3]→[10..12], [7..8]→[13..14]) × 4 KV buffers.
	if len(runs) != 8 {
		t.Fatalf("got %d runs: %+v", len(runs), runs)
	}
	if r := runs[0]; r.SrcOff != testItem || r.DstOff != 10*testItem || r.Len != 3*testItem {
		t.Fatalf("first run %+v", r)
	}
	if r := runs[4]; r.SrcOff != 7*testItem || r.DstOff != 13*testItem || r.Len != 2*testItem {
		t.Fatalf("second run %+v", r)
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
}

// fakePeer accepts one decode connection, answers HELLO like a prefill
// engine, then runs script on the connection.
func fakePeer(t *testing.T, script func(*wire.Conn)) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		nc, err := ln.Accept()
		if err != nil {
			return
		}
		defer nc.Close()
		c := wire.NewConn(nc)
		m, err := c.Read()
		if err != nil {
			return
		}
		h := *m.(*wire.Hello)
		h.Name = "fake"
		if c.Write(&h) == nil {
			script(c)
		}
	}()
	t.Cleanup(func() { ln.Close(); <-done })
	return ln.Addr().String()
}

func TestSilentPeerFailsRoomsWithinTwoHeartbeats(t *testing.T) {
	stop := make(chan struct{})
	addr := fakePeer(t, func(c *wire.Conn) { <-stop })
	defer close(stop)
	const hb = 100 * time.Millisecond
	e, err := New(Config{Name: "D", Transport: &TCP{}, Heartbeat: hb,
		Resolve: func(context.Context, string) (string, error) { return addr, nil }})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	if err := e.RegisterPool(testPool(t, &TCP{}, 0)); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	for i := uint64(1); i <= 3; i++ {
		if err := e.Expect(i, "x", []uint32{uint32(i)}, -1); err != nil {
			t.Fatal(err)
		}
	}
	for i := uint64(1); i <= 3; i++ {
		st := wait(t, e, i, Failed)
		if !strings.Contains(st.Reason, "peer lost") {
			t.Fatalf("reason %q", st.Reason)
		}
	}
	if d := time.Since(start); d > 2*hb+150*time.Millisecond {
		t.Fatalf("rooms failed after %v, want within two heartbeats", d)
	}
	if e.ActiveRooms() != 0 || e.Peers() != 0 {
		t.Fatalf("%d rooms, %d peers left", e.ActiveRooms(), e.Peers())
	}
}

func TestMalformedFrameClosesOnlyThatPeer(t *testing.T) {
	pr := newPair(t, "tcp", nil)
	// A second, broken decode peer says HELLO then sends garbage.
	ln := pr.P.cfg.Listener.Addr().String()
	nc, err := net.Dial("tcp", ln)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	c := wire.NewConn(nc)
	pr.D.mu.Lock()
	h := pr.D.localHello()
	pr.D.mu.Unlock()
	if err := c.Write(h); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Read(); err != nil {
		t.Fatal(err)
	}
	// A healthy room through the real decode peer, in flight meanwhile.
	if err := pr.D.Expect(5, "boot:1", []uint32{1}, -1); err != nil {
		t.Fatal(err)
	}
	eventually(t, "two peers", func() bool { return pr.P.Peers() == 2 })
	if _, err := nc.Write([]byte("KV\x01\x09garbage")); err != nil {
		t.Fatal(err)
	}
	eventually(t, "broken peer closed", func() bool { return pr.P.Peers() == 1 })
	if err := pr.P.Send(5, []uint32{1}, true, -1); err != nil {
		t.Fatal(err)
	}
	wait(t, pr.D, 5, Success)
	_ = nc.SetReadDeadline(time.Now().Add(2 * time.Second))
	for {
		if _, err := c.Read(); err != nil {
			break // closed by P (heartbeats may arrive first)
		}
	}
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
	if err := pr.P.Send(10, nil, true, -1); !errors.Is(err, ErrClosed) {
		t.Fatalf("Send after Close: %v", err)
	}
}

// TestRoomMatchedOverAClosedPeerFails: an XFER_REQ read just before the
// peer's writer or heartbeat closed it is matched after that peer's
// rooms were failed; the room must fail then too, not wait out the
// waiting timeout over a connection that is gone.
func TestRoomMatchedOverAClosedPeerFails(t *testing.T) {
	pr := newPair(t, "tcp", nil)
	if err := pr.D.Expect(1, "boot:1", []uint32{0}, -1); err != nil {
		t.Fatal(err)
	}
	eventually(t, "P accepting D", func() bool { return pr.P.Peers() == 1 })
	pr.P.mu.Lock()
	var p *peer
	for x := range pr.P.peers {
		p = x
	}
	pr.P.mu.Unlock()
	p.close(errors.New("write: connection reset"))
	pr.P.onXferReq(p, &wire.XferReq{Room: 2, AuxSlot: -1, DstPages: []uint32{1}})
	if st, err := pr.P.Poll(2); err != nil || st.State != Failed {
		t.Fatalf("room matched over a closed peer: %+v %v, want Failed", st, err)
	}
	wait(t, pr.D, 1, Failed)
}
