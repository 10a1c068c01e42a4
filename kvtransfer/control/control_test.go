package control

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"net"
	"path/filepath"
	"reflect"
	"strings"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/pdrouter/pdrouter/kvtransfer"
	"github.com/pdrouter/pdrouter/kvtransfer/shm"
	"github.com/pdrouter/pdrouter/kvtransfer/wire"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const (
	pages = 32
	item  = 512
)

// layout: 2 KV buffers of pages×item, then one aux buffer of 4 slots × 8 B.
func layout() (Layout, int) {
	l := Layout{PageSize: 16, Dtype: "bf16"}
	off := uint64(0)
	for i := 0; i < 2; i++ {
		l.Regions = append(l.Regions, RegionSpec{Kind: KindKV, Offset: off, Len: pages * item, ItemLen: item})
		off += pages * item
	}
	l.Regions = append(l.Regions, RegionSpec{Kind: KindAux, Offset: off, Len: 32, ItemLen: 8})
	return l, int(off + 32)
}

type side struct {
	eng  *kvtransfer.Engine
	srv  *Server
	cl   *Client
	seg  *shm.Segment
	sock string
}

func startSide(t *testing.T, name string, peerLn net.Listener, resolve func(context.Context, string) (string, error)) *side {
	t.Helper()
	eng, err := kvtransfer.New(kvtransfer.Config{Name: name, Transport: &kvtransfer.TCP{}, Listener: peerLn, Resolve: resolve,
		Heartbeat: time.Second, WaitingTimeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(t.TempDir(), name+".sock")
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	s := &side{eng: eng, srv: &Server{Engine: eng}, sock: sock}
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- s.srv.Serve(ctx, ln) }()
	if s.cl, err = Dial(sock); err != nil {
		t.Fatal(err)
	}
	l, size := layout()
	tr, fd, err := s.cl.Register(context.Background(), l)
	if err != nil || tr != "tcp" {
		t.Fatalf("register: %q %v", tr, err)
	}
	if s.seg, err = shm.Map(fd); err != nil || len(s.seg.Mem) < size {
		t.Fatalf("map the kvproxy's segment: %v", err)
	}
	t.Cleanup(func() {
		s.cl.Close()
		cancel()
		if err := <-served; err != nil {
			t.Error(err)
		}
		eng.Close()
		s.srv.Close()
		s.seg.Close()
	})
	return s
}

func pair(t *testing.T) (p, d *side) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p = startSide(t, "p", ln, nil)
	d = startSide(t, "d", nil, func(context.Context, string) (string, error) { return ln.Addr().String(), nil })
	return p, d
}

func TestTransferThroughSharedMemory(t *testing.T) {
	p, d := pair(t)
	ctx := context.Background()
	// The prefill engine writes pages 3 and 4 in its own mapping of the segment.
	for i := 3 * item; i < 5*item; i++ {
		p.seg.Mem[i] = byte(i * 7)
		p.seg.Mem[pages*item+i] = byte(i * 11)
	}
	p.seg.Mem[2*pages*item+8] = 0xAB // aux slot 1
	if err := d.cl.Expect(ctx, 42, "p:8998", []uint32{10, 20}, 2); err != nil {
		t.Fatal(err)
	}
	if err := p.cl.Send(ctx, 42, []uint32{3}, false, -1); err != nil {
		t.Fatal(err)
	}
	if err := p.cl.Send(ctx, 42, []uint32{4}, true, 1); err != nil {
		t.Fatal(err)
	}
	st, err := d.cl.Wait(ctx, 42)
	if err != nil || st.State != kvtransfer.Success || st.Pages != 2 || st.Bytes != 4*item+8 {
		t.Fatalf("decode: %+v %v", st, err)
	}
	for b, base := range []int{0, pages * item} {
		if !bytes.Equal(d.seg.Mem[base+10*item:][:item], p.seg.Mem[base+3*item:][:item]) ||
			!bytes.Equal(d.seg.Mem[base+20*item:][:item], p.seg.Mem[base+4*item:][:item]) {
			t.Fatalf("buffer %d: pages did not land in the decode engine's mapping", b)
		}
	}
	if d.seg.Mem[2*pages*item+16] != 0xAB {
		t.Fatal("aux slot did not land")
	}
	// The prefill side reaches Success after it has sent DONE, which can be
	// a moment after decode saw it: wait rather than poll once.
	if st, err := p.cl.Wait(ctx, 42); err != nil || st.State != kvtransfer.Success {
		t.Fatalf("prefill: %+v %v", st, err)
	}
	if err := p.cl.Send(ctx, 42, nil, true, -1); err == nil || !strings.Contains(err.Error(), "finished") {
		t.Fatalf("Send to finished room: %v", err)
	}
}

func TestClientDisconnectAbortsItsRooms(t *testing.T) {
	p, d := pair(t)
	ctx := context.Background()
	if err := d.cl.Expect(ctx, 7, "p:8998", []uint32{1}, -1); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for p.eng.ActiveRooms() == 0 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	d.cl.Close()
	for (p.eng.ActiveRooms() != 0 || d.eng.ActiveRooms() != 0) && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	st, err := p.eng.Poll(7)
	if err != nil || st.State != kvtransfer.Failed || !strings.Contains(st.Reason, "disconnected") {
		t.Fatalf("prefill room after decode engine left: %+v %v", st, err)
	}
	if _, err := d.cl.Poll(ctx, 7); err == nil {
		t.Fatal("call on a closed client succeeded")
	}
}

func TestRegisterRejectsBadLayout(t *testing.T) {
	_, d := pair(t)
	l, _ := layout()
	if _, _, err := d.cl.Register(context.Background(), l); err == nil || !strings.Contains(err.Error(), "already") {
		t.Fatalf("second register: %v", err)
	}
	eng, err := kvtransfer.New(kvtransfer.Config{Transport: &kvtransfer.TCP{}})
	if err != nil {
		t.Fatal(err)
	}
	defer eng.Close()
	sock := filepath.Join(t.TempDir(), "bad.sock")
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	srv := &Server{Engine: eng}
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ctx, ln) }()
	defer func() { cancel(); <-served; srv.Close() }()
	cl, err := Dial(sock)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	huge := Layout{PageSize: 16, Regions: []RegionSpec{{Kind: KindKV, Offset: 1 << 62, Len: 1 << 62, ItemLen: 1}}}
	if _, _, err := cl.Register(ctx, huge); err == nil || !strings.Contains(err.Error(), "too large") {
		t.Fatalf("register of a 2^63-byte pool: %v", err)
	}
	uneven := Layout{PageSize: 16, Regions: []RegionSpec{{Kind: KindKV, Len: 100, ItemLen: 64}}}
	if _, _, err := cl.Register(ctx, uneven); err == nil || !strings.Contains(err.Error(), "multiple") {
		t.Fatalf("register of a region that is not whole items: %v", err)
	}
}

// TestEngineComesBackToItsPool: kvproxy keeps the pool when its engine
// goes away (peers hold its keys); the engine, restarted with the same
// layout, gets the same segment, and moves KV again.
func TestEngineComesBackToItsPool(t *testing.T) {
	p, d := pair(t)
	ctx := context.Background()
	d.seg.Mem[0] = 0x5A // what the first engine process left in the pool
	d.cl.Close()
	sock := d.sock
	l, _ := layout()
	var back *Client
	deadline := time.Now().Add(5 * time.Second)
	for { // until kvproxy has seen the old connection go
		cl, err := Dial(sock)
		if err != nil {
			t.Fatal(err)
		}
		_, fd, err := cl.Register(ctx, l)
		if err == nil {
			seg, err := shm.Map(fd)
			if err != nil {
				t.Fatal(err)
			}
			defer seg.Close()
			if seg.Mem[0] != 0x5A {
				t.Fatal("the engine came back to a new segment, not its pool")
			}
			back = cl
			break
		}
		cl.Close()
		if !strings.Contains(err.Error(), "connected engine") || time.Now().After(deadline) {
			t.Fatalf("register after the engine came back: %v", err)
		}
		time.Sleep(5 * time.Millisecond)
	}
	defer back.Close()
	if _, _, err := d.cl.Register(ctx, l); err == nil {
		t.Fatal("register on a closed client succeeded")
	}
	second, err := Dial(sock)
	if err != nil {
		t.Fatal(err)
	}
	defer second.Close()
	if _, _, err := second.Register(ctx, l); err == nil || !strings.Contains(err.Error(), "connected engine") {
		t.Fatalf("a second engine while the first is connected: %v", err)
	}
	back.Close()
	other := l
	other.PageSize *= 2
	for {
		_, _, err := second.Register(ctx, other)
		if err != nil && strings.Contains(err.Error(), "another layout") {
			break
		}
		if err == nil || !strings.Contains(err.Error(), "connected engine") || time.Now().After(deadline) {
			t.Fatalf("register of another layout: %v", err)
		}
		time.Sleep(5 * time.Millisecond)
	}
	restarted, err := Dial(sock)
	if err != nil {
		t.Fatal(err)
	}
	defer restarted.Close()
	if _, _, err := restarted.Register(ctx, l); err != nil {
		t.Fatalf("register after a refused layout: %v", err)
	}
	if err := restarted.Expect(ctx, 9, "p:8998", []uint32{2}, -1); err != nil {
		t.Fatal(err)
	}
	if err := p.cl.Send(ctx, 9, []uint32{1}, true, -1); err != nil {
		t.Fatal(err)
	}
	if st, err := restarted.Wait(ctx, 9); err != nil || st.State != kvtransfer.Success {
		t.Fatalf("transfer into the re-attached pool: %+v %v", st, err)
	}
}

func TestRoundTrip(t *testing.T) {
	l, _ := layout()
	for _, r := range []*Request{
		{Op: OpRegister, ID: 1, Layout: l},
		{Op: OpExpect, ID: 2, Room: 9, Bootstrap: "h:1", Pages: []uint32{1, 2}, Aux: -1},
		{Op: OpSend, ID: 3, Room: 9, Pages: []uint32{5}, Last: true, Aux: 3},
		{Op: OpPoll, ID: 4, Room: 9, Wait: true},
		{Op: OpAbort, ID: 5, Room: 9, Reason: "x"},
		{Op: OpHello, ID: 6},
		{Op: OpRegisterMemory, ID: 7, Kind: wire.MemHost, Addr: 0x7f0000000000, Len: 1 << 30},
		{Op: OpRegisterMemory, ID: 8, Kind: wire.MemCUDA, Addr: 0x7f0000001000, Len: 4096, Handle: bytes.Repeat([]byte{0xab}, cudaHandleLen), HandleOffset: 4096},
		{Op: OpUnregisterMemory, ID: 9, Addr: 0x7f0000000010},
		{Op: OpWrite, ID: 10, Peer: "127.0.0.1:7000", Triples: []Triple{{Src: 1, Dst: 2, Len: 3}, {Src: 1 << 63, Dst: 5, Len: 1 << 40}}},
		{Op: OpWrite, ID: 11, Peer: "h:1", Triples: []Triple{}},
		{Op: OpProbe, ID: 12, Peer: "127.0.0.1:7000"},
		{Op: OpWritePages, ID: 13, Peer: "127.0.0.1:7000", PageWrite: kvtransfer.PageWrite{
			Bufs:  []kvtransfer.PageBuf{{Src: 1 << 40, Dst: 2 << 40, PageLen: 32 << 10}, {Src: 5, Dst: 6, PageLen: 7}},
			Pairs: []kvtransfer.PagePair{{Src: 0, Dst: 1}, {Src: 1<<32 - 1, Dst: 3}}}},
		{Op: OpWritePages, ID: 14, Peer: "h:1", PageWrite: kvtransfer.PageWrite{Bufs: []kvtransfer.PageBuf{}, Pairs: []kvtransfer.PagePair{}}},
	} {
		f := EncodeRequest(r)
		body, rest, err := splitFrame(f)
		if err != nil || len(rest) != 0 {
			t.Fatal(err)
		}
		got, err := DecodeRequest(body)
		if err != nil || !reflect.DeepEqual(got, r) {
			t.Fatalf("%+v -> %+v %v", r, got, err)
		}
	}
	for _, rep := range []*Reply{
		{Op: OpPoll, ID: 4, State: 4, Reason: "r", Pages: 1, Bytes: 2, TransferNs: 3, WallNs: 4},
		{Op: OpHello, ID: 6, PeerAddr: "127.0.0.1:7000", Transport: "ucx"},
		{Op: OpHello, ID: 6, PeerAddr: "127.0.0.1:7000", Transport: "ucx", Features: FeatureWritePages},
		{Op: OpWrite, ID: 10, Err: "write to h:1: dial tcp: refused"},
	} {
		body, _, _ := splitFrame(EncodeReply(rep))
		if got, err := DecodeReply(body); err != nil || !reflect.DeepEqual(got, rep) {
			t.Fatalf("reply %+v %v", got, err)
		}
	}
}

func TestDecodeRejectsBadMemoryRequests(t *testing.T) {
	short := EncodeRequest(&Request{Op: OpRegisterMemory, Kind: wire.MemCUDA, Handle: make([]byte, 10)})[4:]
	kind := EncodeRequest(&Request{Op: OpRegisterMemory, Kind: 9})[4:]
	// A Write that claims more triples than its bytes hold.
	many := EncodeRequest(&Request{Op: OpWrite, Peer: "p", Triples: []Triple{{Src: 1, Dst: 2, Len: 3}}})[4:]
	binary.LittleEndian.PutUint32(many[9+4+1:], 1000)
	huge := EncodeRequest(&Request{Op: OpWrite, Peer: "p"})[4:]
	binary.LittleEndian.PutUint32(huge[9+4+1:], 1<<31)
	for name, b := range map[string][]byte{"short cuda handle": short, "unknown kind": kind, "triples overrun": many, "huge triple count": huge} {
		if _, err := DecodeRequest(b); !errors.Is(err, wire.ErrMalformed) {
			t.Errorf("%s: %v, want ErrMalformed", name, err)
		}
	}
}

func FuzzDecodeRequest(f *testing.F) {
	l, _ := layout()
	f.Add(EncodeRequest(&Request{Op: OpRegister, Layout: l})[4:])
	f.Add(EncodeRequest(&Request{Op: OpExpect, Room: 1, Bootstrap: "a:1", Pages: []uint32{1}})[4:])
	f.Add(EncodeRequest(&Request{Op: OpSend, Room: 1, Pages: []uint32{1}, Last: true})[4:])
	f.Add(EncodeReply(&Reply{Op: OpPoll, Reason: "x"})[4:])
	f.Add(EncodeRequest(&Request{Op: OpHello})[4:])
	f.Add(EncodeRequest(&Request{Op: OpRegisterMemory, Addr: 4096, Len: 4096})[4:])
	f.Add(EncodeRequest(&Request{Op: OpRegisterMemory, Kind: wire.MemCUDA, Handle: make([]byte, cudaHandleLen)})[4:])
	f.Add(EncodeRequest(&Request{Op: OpUnregisterMemory, Addr: 1})[4:])
	f.Add(EncodeRequest(&Request{Op: OpWrite, Peer: "h:1", Triples: []Triple{{Src: 1, Dst: 2, Len: 3}}})[4:])
	f.Add(EncodeRequest(&Request{Op: OpProbe, Peer: "h:1"})[4:])
	f.Add(EncodeReply(&Reply{Op: OpHello, PeerAddr: "h:1", Transport: "tcp"})[4:])
	f.Add(EncodeRequest(&Request{Op: OpWritePages, Peer: "h:1", PageWrite: kvtransfer.PageWrite{
		Bufs: []kvtransfer.PageBuf{{Src: 1, Dst: 2, PageLen: 3}}, Pairs: []kvtransfer.PagePair{{Src: 4, Dst: 5}}}})[4:])
	f.Fuzz(func(t *testing.T, b []byte) {
		if r, err := DecodeRequest(b); err == nil {
			body, _, _ := splitFrame(EncodeRequest(r))
			again, err := DecodeRequest(body)
			if err != nil || !reflect.DeepEqual(again, r) {
				t.Fatalf("re-encode %+v: %+v %v", r, again, err)
			}
		}
		_, _ = DecodeReply(b)
	})
}

// TestReattachWaitsForTheOldRoomsToEnd: a restarted engine gets its pool
// back only once the rooms of the engine that left are over, or pages of
// an old room could still land in pages the new engine handed out afresh.
func TestReattachWaitsForTheOldRoomsToEnd(t *testing.T) {
	_, d := pair(t)
	ctx := context.Background()
	if err := d.cl.Expect(ctx, 7, "p:8998", []uint32{1}, -1); err != nil {
		t.Fatal(err)
	}
	d.srv.mu.Lock()
	old := d.srv.owner
	d.srv.mu.Unlock()
	// Hold the old connection's cleanup at its rooms: kvproxy must not
	// let the pool go before it gets past them.
	old.rmu.Lock()
	held := true
	defer func() {
		if held {
			old.rmu.Unlock()
		}
	}()
	d.cl.Close()
	l, _ := layout()
	attach := func() (*Client, error) {
		cl, err := Dial(d.sock)
		if err != nil {
			t.Fatal(err)
		}
		_, fd, err := cl.Register(ctx, l)
		if err != nil {
			cl.Close()
			return nil, err
		}
		syscall.Close(fd)
		return cl, nil
	}
	for deadline := time.Now().Add(time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		cl, err := attach()
		if err == nil {
			cl.Close()
			st, _ := d.eng.Poll(7)
			t.Fatalf("pool re-attached while a room of the engine that left is %v", st.State)
		}
		if !strings.Contains(err.Error(), "connected engine") {
			t.Fatal(err)
		}
	}
	old.rmu.Unlock()
	held = false
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		cl, err := attach()
		if err == nil {
			defer cl.Close()
			break
		}
		if !strings.Contains(err.Error(), "connected engine") || time.Now().After(deadline) {
			t.Fatalf("re-attach: %v", err)
		}
	}
	if st, err := d.eng.Poll(7); err != nil || !st.State.Terminal() {
		t.Fatalf("room of the engine that left, after re-attach: %+v %v", st, err)
	}
}

// TestLongAbortReason: an engine's abort reason of the longest length the
// control API takes comes back (prefixed) in the room's status and goes to
// the peer in an ABORT; neither may break a connection, or the reply kills
// the engine's control connection and the ABORT every room on the link.
func TestLongAbortReason(t *testing.T) {
	p, d := pair(t)
	ctx := context.Background()
	for _, room := range []uint64{1, 2} {
		if err := d.cl.Expect(ctx, room, "p:8998", []uint32{uint32(room)}, -1); err != nil {
			t.Fatal(err)
		}
	}
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		st, err := d.cl.Poll(ctx, 1)
		if err != nil {
			t.Fatal(err)
		}
		if st.State != kvtransfer.Bootstrapping {
			break // matched: aborting it sends the prefill an ABORT
		}
		if time.Now().After(deadline) {
			t.Fatal("room 1 never matched")
		}
	}
	if err := d.cl.Abort(ctx, 1, strings.Repeat("r", 4096)); err != nil {
		t.Fatal(err)
	}
	if st, err := d.cl.Poll(ctx, 1); err != nil || st.State != kvtransfer.Failed || !strings.Contains(st.Reason, "rrrr") {
		t.Fatalf("aborted room: %+v %v", st.State, err)
	}
	if err := p.cl.Send(ctx, 2, []uint32{3}, true, -1); err != nil {
		t.Fatal(err)
	}
	if st, err := d.cl.Wait(ctx, 2); err != nil || st.State != kvtransfer.Success {
		t.Fatalf("the other room on the link: %v %q %v", st.State, st.Reason, err)
	}
}

// TestAbortedRoomIsNotTracked: a room the engine aborted is over, so the
// connection stops tracking it; only a terminal Poll untracked rooms, and
// a long-lived engine that aborts rooms it never waits for (a failed Send)
// grew its connection's table for as long as it stayed connected.
func TestAbortedRoomIsNotTracked(t *testing.T) {
	_, d := pair(t)
	ctx := context.Background()
	if err := d.cl.Expect(ctx, 5, "p:8998", []uint32{1}, -1); err != nil {
		t.Fatal(err)
	}
	if err := d.cl.Abort(ctx, 5, "client went away"); err != nil {
		t.Fatal(err)
	}
	d.srv.mu.Lock()
	c := d.srv.owner
	d.srv.mu.Unlock()
	c.rmu.Lock()
	n := len(c.rooms)
	c.rmu.Unlock()
	if n != 0 {
		t.Fatalf("%d rooms still tracked after the engine aborted its only one", n)
	}
}
