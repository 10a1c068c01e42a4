package wire

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"reflect"
	"runtime"
	"strings"
	"testing"
	"testing/iotest"
	"time"
	"unicode/utf8"
)

func sample() []Msg {
	return []Msg{
		&XferReq{Room: 1<<63 - 1, AuxSlot: -1, PageSize: 16, Dtype: "bf16", DstPages: []uint32{4, 5, 6, 100},
			Bufs: []RoomBuf{{Kind: KindKV, Addr: 0x7f00, ItemLen: 32 << 10, Items: 32}, {Kind: KindAux, Addr: 1, ItemLen: 8, Items: 8}}},
		&XferReq{Room: 7, AuxSlot: 3, DstPages: []uint32{}},
		&Done{Room: 7, Chunk: 2, Last: true, Status: StatusFailed, Pages: 3, Bytes: 1 << 40, Nanos: 5},
		&Abort{Room: 9, Reason: "client gone"},
		&Heartbeat{Seq: 42},
		&MemHello{Name: "d0", Transport: "tcp", WorkerAddr: []byte{7}, ListenAddr: "127.0.0.1:9000",
			Regions: []MemRegion{{ID: 3, Kind: MemHost, Base: 0x7f0000001000, Len: 8192, Addr: 0x7e0000000000, RKey: []byte{1, 2}}, {ID: 4, Kind: MemCUDA, Base: 1, Len: 1}}},
		&MemRegionsReq{Seq: 5},
		&MemRegions{Seq: 0, Regions: []MemRegion{{ID: 1, Base: 4096, Len: 4096}}},
		&MemRegions{Seq: 6},
		&MemFence{Seq: 9},
		&MemFenceAck{Seq: 9, Err: "region 3 unregistered"},
		&MemStageReq{Seq: 10, SlotLen: 1 << 20, Slots: 4},
		&MemStageRing{Seq: 10, Addr: 0x7f0000000000, SlotLen: 1 << 20, Slots: 4, RKey: []byte{9, 8}},
		&MemStageRing{Seq: 11, Err: "no GPU here"},
		&MemStaged{Slot: 3, Pieces: []StagedPiece{{Region: 2, Offset: 4096, N: 8192}, {Region: 5, N: 1}}},
		&MemStageFree{Slot: 3},
		&MemClient{Name: "engine 7"},
	}
}

func TestRoundTrip(t *testing.T) {
	for _, m := range sample() {
		frame := AppendFrame(nil, m)
		var buf []byte
		var pending uint32
		got, err := ReadMsg(bytes.NewReader(frame), &buf, &pending)
		if err != nil {
			t.Fatalf("%s: %v", m.Type(), err)
		}
		if !reflect.DeepEqual(normalize(got), normalize(m)) {
			t.Fatalf("%s: got %+v want %+v", m.Type(), got, m)
		}
	}
}

// normalize maps nil and empty slices together: the codec does not keep the difference.
func normalize(m Msg) Msg {
	switch v := m.(type) {
	case *XferReq:
		c := *v
		if len(c.DstPages) == 0 {
			c.DstPages = nil
		}
		return &c
	case *MemHello:
		c := *v
		c.Regions = normalizeMem(v.Regions)
		return &c
	case *MemRegions:
		c := *v
		c.Regions = normalizeMem(v.Regions)
		return &c
	case *MemStageRing:
		c := *v
		if len(c.RKey) == 0 {
			c.RKey = nil
		}
		return &c
	}
	return m
}

func normalizeMem(rs []MemRegion) []MemRegion {
	if len(rs) == 0 {
		return nil
	}
	out := append([]MemRegion(nil), rs...)
	for i := range out {
		if len(out[i].RKey) == 0 {
			out[i].RKey = nil
		}
	}
	return out
}

func TestDataFrameOverConn(t *testing.T) {
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	ca, cb := NewConn(a), NewConn(b)
	payload := bytes.Repeat([]byte("kvpage"), 1000)
	go func() {
		_ = ca.WriteData(3, 4096, payload)
		_ = ca.Write(&Done{Room: 1, Last: true, Bytes: uint64(len(payload))})
	}()
	m, err := cb.Read()
	if err != nil {
		t.Fatal(err)
	}
	d, ok := m.(*Data)
	if !ok || d.Region != 3 || d.Offset != 4096 || int(d.N) != len(payload) {
		t.Fatalf("bad data header %+v", m)
	}
	if _, err := cb.Read(); err == nil {
		t.Fatal("Read with DATA bytes pending must fail")
	}
	dst := make([]byte, d.N)
	if err := cb.ReadData(dst); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(dst, payload) {
		t.Fatal("payload differs")
	}
	m, err = cb.Read()
	if err != nil {
		t.Fatal(err)
	}
	if dn, ok := m.(*Done); !ok || !dn.Last || dn.Bytes != uint64(len(payload)) {
		t.Fatalf("bad done %+v", m)
	}
}

func TestMalformed(t *testing.T) {
	good := AppendFrame(nil, &XferReq{Room: 1, AuxSlot: 0, DstPages: []uint32{1, 2}})
	cases := map[string][]byte{
		"bad magic":      append([]byte{'X'}, good[1:]...),
		"bad version":    append(append([]byte{}, good[:2]...), append([]byte{Version + 1}, good[3:]...)...),
		"unknown type":   append(append([]byte{}, good[:3]...), append([]byte{99}, good[4:]...)...),
		"huge length":    append(append([]byte{}, good[:4]...), 0xff, 0xff, 0xff, 0x7f),
		"trailing byte":  withLen(append(append([]byte{}, good...), 0), len(good)+1-HeaderLen),
		"short count":    withLen(append([]byte{}, good[:len(good)-4]...), len(good)-4-HeaderLen),
		"data too big":   {magic0, magic1, Version, byte(TData), 0xff, 0xff, 0xff, 0xff},
		"data too small": {magic0, magic1, Version, byte(TData), 4, 0, 0, 0},
	}
	done := AppendFrame(nil, &Done{Room: 1})
	done[HeaderLen+12] = 2 // Last is neither 0 nor 1
	cases["bad bool"] = done
	for name, r := range map[string]MemRegion{
		"empty memory region": {ID: 1, Base: 4096},
		"memory region wraps": {ID: 1, Base: 1<<64 - 4096, Len: 8192},
		"unknown memory kind": {ID: 1, Kind: MemCUDA + 1, Base: 4096, Len: 1},
	} {
		cases[name] = AppendFrame(nil, &MemRegions{Regions: []MemRegion{r}})
	}
	cases["room buffer kind"] = AppendFrame(nil, &XferReq{Bufs: []RoomBuf{{Kind: KindAux + 1, ItemLen: 8}}})
	cases["room buffer item"] = AppendFrame(nil, &XferReq{Bufs: []RoomBuf{{Kind: KindKV}}})
	cases["room buffer count"] = withLen(append(AppendFrame(nil, &XferReq{})[:HeaderLen+20], 0xff, 0xff, 0xff, 0xff), 24)
	cases["mem hello region count"] = withLen(append(AppendFrame(nil, &MemHello{})[:HeaderLen+16], 0xff, 0xff, 0xff, 0xff), 20)
	for name, frame := range cases {
		var buf []byte
		var pending uint32
		_, err := ReadMsg(bytes.NewReader(frame), &buf, &pending)
		if !errors.Is(err, ErrMalformed) {
			t.Errorf("%s: got %v, want ErrMalformed", name, err)
		}
	}
	var buf []byte
	var pending uint32
	if _, err := ReadMsg(bytes.NewReader(good[:HeaderLen+3]), &buf, &pending); !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Errorf("truncated payload: got %v", err)
	}
}

func withLen(f []byte, n int) []byte {
	binary.LittleEndian.PutUint32(f[4:], uint32(n))
	return f
}

func FuzzReadMsg(f *testing.F) {
	for _, m := range sample() {
		f.Add(AppendFrame(nil, m))
	}
	f.Add(append(AppendFrame(nil, &Data{Region: 1, Offset: 2, N: 3}), 1, 2, 3))
	f.Fuzz(func(t *testing.T, b []byte) {
		var buf []byte
		var pending uint32
		r := bytes.NewReader(b)
		for {
			m, err := ReadMsg(r, &buf, &pending)
			if err != nil {
				return
			}
			if d, ok := m.(*Data); ok {
				if pending != d.N || d.N > MaxDataLen {
					t.Fatalf("pending %d for %+v", pending, d)
				}
				if _, err := io.CopyN(io.Discard, r, int64(d.N)); err != nil {
					return
				}
				pending = 0
				continue
			}
			// A decoded message must re-encode to a frame that decodes the same.
			again, err := ReadMsg(bytes.NewReader(AppendFrame(nil, m)), &buf, &pending)
			if err != nil || !reflect.DeepEqual(normalize(again), normalize(m)) {
				t.Fatalf("re-encode of %+v: %+v, %v", m, again, err)
			}
		}
	})
}

// TestLongTextStillDecodes: free text (an abort's reason, a fence's error)
// longer than a decoder accepts is cut when encoded; sent whole it made
// the peer drop the connection and every room on it.
func TestLongTextStillDecodes(t *testing.T) {
	long := strings.Repeat("é", maxString) // 2 bytes a rune: the cut must not split one
	for _, m := range []Msg{&Abort{Room: 1, Reason: long}, &MemFenceAck{Seq: 2, Err: long}} {
		var buf []byte
		var pending uint32
		got, err := ReadMsg(bytes.NewReader(AppendFrame(nil, m)), &buf, &pending)
		if err != nil {
			t.Fatalf("%s with %d bytes of text: %v", m.Type(), len(long), err)
		}
		var text string
		switch g := got.(type) {
		case *Abort:
			text = g.Reason
		case *MemFenceAck:
			text = g.Err
		}
		if len(text) == 0 || len(text) > maxString || !strings.HasPrefix(long, text) || !utf8.ValidString(text) {
			t.Fatalf("%s: text of %d bytes, want a valid prefix of at most %d", m.Type(), len(text), maxString)
		}
	}
}

// A frame's declared length is not allocated before its bytes come: a
// header declaring the largest control payload, followed by a few bytes and
// the end of the stream, costs about what arrived.
func TestTruncatedFrameAllocatesWhatArrived(t *testing.T) {
	f := withLen(AppendFrame(nil, &Heartbeat{Seq: 1}), MaxControlLen)
	f = append(f, make([]byte, 100)...)
	var buf []byte
	var pending uint32
	if _, err := ReadMsg(bytes.NewReader(f), &buf, &pending); !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Fatalf("truncated frame: %v", err)
	}
	if cap(buf) > 256<<10 {
		t.Fatalf("a frame that sent %d bytes grew the buffer to %d", len(f), cap(buf))
	}
	// A whole large frame still reads (in growing pieces).
	big := &XferReq{Room: 3, AuxSlot: -1, DstPages: make([]uint32, 100_000)}
	for i := range big.DstPages {
		big.DstPages[i] = uint32(i * 7)
	}
	m, err := ReadMsg(iotest.OneByteReader(bytes.NewReader(AppendFrame(nil, big))), &buf, &pending)
	if err != nil || !reflect.DeepEqual(m, big) {
		t.Fatalf("whole frame after a truncated one: %+v %v", m, err)
	}
}

// Post does not wait behind a write blocked on a peer that is not reading,
// and its frames go out after that write and before any later one.
func TestPostDoesNotWaitForTheWriteLock(t *testing.T) {
	p1, p2 := net.Pipe()
	defer p1.Close()
	defer p2.Close()
	w, r := NewConn(p1), NewConn(p2)
	data := make([]byte, 1<<20)
	wrote := make(chan error, 1)
	go func() { wrote <- w.WriteData(1, 0, data) }()
	for w.wmu.TryLock() { // until the write holds the lock (blocked: nobody reads yet)
		w.wmu.Unlock()
		runtime.Gosched()
	}
	posted := make(chan struct{})
	go func() {
		w.Post(&Heartbeat{Seq: 1})
		w.Post(&Heartbeat{Seq: 2})
		close(posted)
	}()
	select {
	case <-posted:
	case <-time.After(10 * time.Second):
		t.Fatal("Post waited for the write lock")
	}
	later := make(chan error, 1)
	go func() { later <- w.Write(&Heartbeat{Seq: 3}) }()
	m, err := r.Read()
	if d, ok := m.(*Data); err != nil || !ok || d.N != uint32(len(data)) {
		t.Fatalf("first frame: %+v %v", m, err)
	}
	if err := r.ReadData(make([]byte, len(data))); err != nil {
		t.Fatal(err)
	}
	for want := uint64(1); want <= 3; want++ {
		m, err := r.Read()
		if h, ok := m.(*Heartbeat); err != nil || !ok || h.Seq != want {
			t.Fatalf("frame %d: %+v %v", want, m, err)
		}
	}
	if err := <-wrote; err != nil {
		t.Fatal(err)
	}
	if err := <-later; err != nil {
		t.Fatal(err)
	}
}

// TestTypeNumbers: frame types are the wire format; a renumbering breaks
// every peer of another build (1 was the retired pool HELLO).
func TestTypeNumbers(t *testing.T) {
	for typ, want := range map[Type]uint8{TXferReq: 2, TData: 3, TDone: 4, TAbort: 5, THeartbeat: 6, TMemHello: 7, TMemRegionsReq: 8, TMemRegions: 9, TMemFence: 10, TMemFenceAck: 11,
		TMemStageReq: 12, TMemStageRing: 13, TMemStaged: 14, TMemStageFree: 15, TMemClient: 16} {
		if uint8(typ) != want {
			t.Errorf("%s is %d, want %d", typ, uint8(typ), want)
		}
	}
}

// A MEM_STAGED naming more pieces than a slot can hold is refused before
// anything is allocated for them.
func TestStagedPiecesBounded(t *testing.T) {
	e := Enc{}
	e.U32(0)
	e.U32(maxStagedPieces + 1)
	if _, err := Decode(TMemStaged, e.B); !errors.Is(err, ErrMalformed) {
		t.Fatalf("%d pieces: %v", maxStagedPieces+1, err)
	}
}
