package control

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"net"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"
	"unsafe"

	"go.uber.org/goleak"

	"github.com/pdrouter/pdrouter/kvtransfer"
	"github.com/pdrouter/pdrouter/kvtransfer/rooms"
	"github.com/pdrouter/pdrouter/kvtransfer/shm"
	"github.com/pdrouter/pdrouter/kvtransfer/wire"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const (
	pages = 32
	item  = 512
)

// pool is an engine's KV memory: 2 KV buffers of pages×item, then one aux
// buffer of 4 slots × 8 B, in a memfd the engine allocated.
type pool struct {
	seg    *shm.Segment
	layout RoomLayout
}

func newPool(t *testing.T) *pool {
	t.Helper()
	seg, err := shm.Create("test", 2*pages*item+32)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { seg.Close() })
	base := uint64(uintptr(unsafe.Pointer(unsafe.SliceData(seg.Mem))))
	l := RoomLayout{PageSize: 16, Dtype: "bf16"}
	for i := 0; i < 2; i++ {
		l.Bufs = append(l.Bufs, RoomBuf{Kind: KindKV, Addr: base + uint64(i*pages*item), ItemLen: item, Items: pages})
	}
	l.Bufs = append(l.Bufs, RoomBuf{Kind: KindAux, Addr: base + 2*pages*item, ItemLen: 8, Items: 4})
	return &pool{seg: seg, layout: l}
}

// attach registers p and its layout on cl, as an engine does at start.
func (p *pool) attach(cl *Client) error {
	ctx := context.Background()
	if err := cl.RegisterMemory(ctx, p.layout.Bufs[0].Addr, uint64(len(p.seg.Mem)), p.seg.Fd()); err != nil {
		return err
	}
	return cl.RoomLayout(ctx, p.layout)
}

type side struct {
	rooms *rooms.Rooms
	srv   *Server
	cl    *Client
	pool  *pool
	sock  string
}

func startSide(t *testing.T, name string, resolve func(context.Context, string) (string, error)) *side {
	t.Helper()
	peerLn, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	plane, err := kvtransfer.NewMemoryPlane(kvtransfer.MemoryConfig{Name: name, Transport: &kvtransfer.TCP{}, Listener: peerLn})
	if err != nil {
		t.Fatal(err)
	}
	rs, err := rooms.New(rooms.Config{Memory: plane, Resolve: resolve, Heartbeat: time.Second, WaitingTimeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(t.TempDir(), name+".sock")
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	s := &side{rooms: rs, srv: &Server{Rooms: rs, Memory: plane}, sock: sock, pool: newPool(t)}
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- s.srv.Serve(ctx, ln) }()
	if s.cl, err = Dial(sock); err != nil {
		t.Fatal(err)
	}
	if err := s.pool.attach(s.cl); err != nil {
		t.Fatalf("register the pool: %v", err)
	}
	t.Cleanup(func() {
		s.cl.Close()
		cancel()
		if err := <-served; err != nil {
			t.Error(err)
		}
		rs.Close()
		plane.Close()
	})
	return s
}

func pair(t *testing.T) (p, d *side) {
	p = startSide(t, "p", nil)
	peer := p.srv.Memory.PeerAddr()
	d = startSide(t, "d", func(context.Context, string) (string, error) { return peer, nil })
	return p, d
}

func TestTransferIntoEngineMemory(t *testing.T) {
	p, d := pair(t)
	ctx := context.Background()
	// The prefill engine writes pages 3 and 4 in its own memory.
	for i := 3 * item; i < 5*item; i++ {
		p.pool.seg.Mem[i] = byte(i * 7)
		p.pool.seg.Mem[pages*item+i] = byte(i * 11)
	}
	p.pool.seg.Mem[2*pages*item+8] = 0xAB // aux slot 1
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
	if err != nil || st.State != rooms.Success || st.Pages != 2 || st.Bytes != 4*item+8 {
		t.Fatalf("decode: %+v %v", st, err)
	}
	for b, base := range []int{0, pages * item} {
		if !bytes.Equal(d.pool.seg.Mem[base+10*item:][:item], p.pool.seg.Mem[base+3*item:][:item]) ||
			!bytes.Equal(d.pool.seg.Mem[base+20*item:][:item], p.pool.seg.Mem[base+4*item:][:item]) {
			t.Fatalf("buffer %d: pages did not land in the decode engine's memory", b)
		}
	}
	if d.pool.seg.Mem[2*pages*item+16] != 0xAB {
		t.Fatal("aux slot did not land")
	}
	// The prefill side reaches Success after it has sent DONE, which can be
	// a moment after decode saw it: wait rather than poll once.
	if st, err := p.cl.Wait(ctx, 42); err != nil || st.State != rooms.Success {
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
	for p.rooms.ActiveRooms() == 0 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	d.cl.Close()
	for (p.rooms.ActiveRooms() != 0 || d.rooms.ActiveRooms() != 0) && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	st, err := p.rooms.Poll(7)
	if err != nil || st.State != rooms.Failed || !strings.Contains(st.Reason, "disconnected") {
		t.Fatalf("prefill room after decode engine left: %+v %v", st, err)
	}
	if _, err := d.cl.Poll(ctx, 7); err == nil {
		t.Fatal("call on a closed client succeeded")
	}
}

func TestRoomLayoutRefused(t *testing.T) {
	p, d := pair(t)
	ctx := context.Background()
	// Another engine of the same kvproxy while the first is connected.
	other, err := Dial(d.sock)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	if err := newPool(t).attach(other); err == nil || !strings.Contains(err.Error(), "another connected engine") {
		t.Fatalf("a second engine's layout: %v", err)
	}
	// Buffers outside the memory this connection registered.
	l := d.pool.layout
	if err := other.RoomLayout(ctx, l); err == nil || !strings.Contains(err.Error(), "not registered") {
		t.Fatalf("a layout in another engine's memory: %v", err)
	}
	bad := l
	bad.Bufs = slices.Clone(l.Bufs)
	bad.Bufs[1].Items++
	if err := d.cl.RoomLayout(ctx, bad); err == nil || !strings.Contains(err.Error(), "items") {
		t.Fatalf("uneven buffers: %v", err)
	}
	bad.Bufs = l.Bufs[2:]
	if err := d.cl.RoomLayout(ctx, bad); err == nil || !strings.Contains(err.Error(), "no KV buffer") {
		t.Fatalf("no KV buffer: %v", err)
	}
	bad.Bufs = []RoomBuf{{Kind: KindKV, Addr: 1 << 63, ItemLen: 1 << 31, Items: 1 << 31}}
	if err := d.cl.RoomLayout(ctx, bad); err == nil || !strings.Contains(err.Error(), "not registered") {
		t.Fatalf("a layout far outside: %v", err)
	}
	// The refused layouts changed nothing: the first engine still moves KV.
	if err := d.cl.Expect(ctx, 3, "p:8998", []uint32{1}, -1); err != nil {
		t.Fatal(err)
	}
	if err := p.cl.Send(ctx, 3, []uint32{2}, true, -1); err != nil {
		t.Fatal(err)
	}
	if st, err := d.cl.Wait(ctx, 3); err != nil || st.State != rooms.Success {
		t.Fatalf("after refused layouts: %+v %v", st, err)
	}
}

// TestRestartedEngineRegistersAgain: an engine that restarts brings new
// memory; it registers it and its layout again on a new connection, once
// kvproxy has seen the old connection go, and moves KV again.
func TestRestartedEngineRegistersAgain(t *testing.T) {
	p, d := pair(t)
	ctx := context.Background()
	if err := d.cl.Expect(ctx, 7, "p:8998", []uint32{1}, -1); err != nil {
		t.Fatal(err)
	}
	d.cl.Close()
	back, err := Dial(d.sock)
	if err != nil {
		t.Fatal(err)
	}
	defer back.Close()
	fresh := newPool(t)
	ctxRooms := d.rooms
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		err := fresh.attach(back)
		if err == nil {
			// Only now: the rooms of the engine that left are over.
			if st, err := ctxRooms.Poll(7); err != nil || !st.State.Terminal() {
				t.Fatalf("room of the engine that left, after the new layout: %+v %v", st, err)
			}
			break
		}
		if !strings.Contains(err.Error(), "another connected engine") || time.Now().After(deadline) {
			t.Fatalf("register after the engine came back: %v", err)
		}
	}
	for i := 5 * item; i < 6*item; i++ {
		p.pool.seg.Mem[i] = byte(i * 3)
	}
	if err := back.Expect(ctx, 9, "p:8998", []uint32{2}, -1); err != nil {
		t.Fatal(err)
	}
	if err := p.cl.Send(ctx, 9, []uint32{5}, true, -1); err != nil {
		t.Fatal(err)
	}
	if st, err := back.Wait(ctx, 9); err != nil || st.State != rooms.Success {
		t.Fatalf("transfer into the restarted engine: %+v %v", st, err)
	}
	if !bytes.Equal(fresh.seg.Mem[2*item:3*item], p.pool.seg.Mem[5*item:6*item]) {
		t.Fatal("the page did not land in the restarted engine's new memory")
	}
}

func TestRoundTrip(t *testing.T) {
	l := RoomLayout{PageSize: 16, Dtype: "bf16", Bufs: []RoomBuf{{Kind: KindKV, Addr: 1 << 40, ItemLen: 512, Items: 32}, {Kind: KindAux, Addr: 7, ItemLen: 8, Items: 4}}}
	for _, r := range []*Request{
		{Op: OpRoomLayout, ID: 1, Layout: l},
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
		{Op: OpDirectRoute, ID: 15, Peer: "127.0.0.1:7000"},
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
		{Op: OpDirectRoute, ID: 15, Direct: true, WriteTimeoutNs: 5e9},
		{Op: OpDirectRoute, ID: 16, Reason: "host memory goes to h:1 by shm, not tcp"},
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
	l := RoomLayout{PageSize: 16, Dtype: "bf16", Bufs: []RoomBuf{{Kind: KindKV, Addr: 1 << 40, ItemLen: 512, Items: 32}}}
	f.Add(EncodeRequest(&Request{Op: OpRoomLayout, Layout: l})[4:])
	f.Add(EncodeRequest(&Request{Op: OpExpect, Room: 1, Bootstrap: "a:1", Pages: []uint32{1}})[4:])
	f.Add(EncodeRequest(&Request{Op: OpSend, Room: 1, Pages: []uint32{1}, Last: true})[4:])
	f.Add(EncodeReply(&Reply{Op: OpPoll, Reason: "x"})[4:])
	f.Add(EncodeRequest(&Request{Op: OpHello})[4:])
	f.Add(EncodeRequest(&Request{Op: OpRegisterMemory, Addr: 4096, Len: 4096})[4:])
	f.Add(EncodeRequest(&Request{Op: OpRegisterMemory, Kind: wire.MemCUDA, Handle: make([]byte, cudaHandleLen)})[4:])
	f.Add(EncodeRequest(&Request{Op: OpUnregisterMemory, Addr: 1})[4:])
	f.Add(EncodeRequest(&Request{Op: OpWrite, Peer: "h:1", Triples: []Triple{{Src: 1, Dst: 2, Len: 3}}})[4:])
	f.Add(EncodeRequest(&Request{Op: OpProbe, Peer: "h:1"})[4:])
	f.Add(EncodeRequest(&Request{Op: OpDirectRoute, Peer: "h:1"})[4:])
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
		if st.State != rooms.Bootstrapping {
			break // matched: aborting it sends the prefill an ABORT
		}
		if time.Now().After(deadline) {
			t.Fatal("room 1 never matched")
		}
	}
	if err := d.cl.Abort(ctx, 1, strings.Repeat("r", 4096)); err != nil {
		t.Fatal(err)
	}
	if st, err := d.cl.Poll(ctx, 1); err != nil || st.State != rooms.Failed || !strings.Contains(st.Reason, "rrrr") {
		t.Fatalf("aborted room: %+v %v", st.State, err)
	}
	if err := p.cl.Send(ctx, 2, []uint32{3}, true, -1); err != nil {
		t.Fatal(err)
	}
	if st, err := d.cl.Wait(ctx, 2); err != nil || st.State != rooms.Success {
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
	var c *conn
	for x := range d.srv.conns {
		c = x
	}
	d.srv.mu.Unlock()
	c.rmu.Lock()
	n := len(c.rooms)
	c.rmu.Unlock()
	if n != 0 {
		t.Fatalf("%d rooms still tracked after the engine aborted its only one", n)
	}
}

// TestOpNumbers: ops are the control API; python/pdrouter_kv/control.py
// and engines built against it use these numbers (1 was the retired pool
// Register).
func TestOpNumbers(t *testing.T) {
	for op, want := range map[Op]uint8{OpExpect: 2, OpSend: 3, OpPoll: 4, OpAbort: 5, OpHello: 6, OpRegisterMemory: 7,
		OpUnregisterMemory: 8, OpWrite: 9, OpProbe: 10, OpWritePages: 11, OpRoomLayout: 12, OpDirectRoute: 13} {
		if uint8(op) != want {
			t.Errorf("op %d, want %d", uint8(op), want)
		}
	}
}
