// Package wire is the kvproxy ↔ kvproxy peer protocol: versioned,
// length-prefixed binary frames over one TCP connection per peer pair.
//
// Frame: magic "KV" (2 bytes), version (1), type (1), payload length (u32 LE),
// payload. A link opens with MEM_HELLO each way (memory.go: the region
// tables). Rooms ride on the same link: per room the decode side sends
// XFER_REQ (its buffer layout and page indices); the prefill side writes the
// pages into the decode engine's registered memory as any engine-memory
// write goes, then sends DONE per chunk once the data is complete at the
// target. ABORT goes either way; while rooms use a link both sides send
// HEARTBEAT every interval.
package wire

import (
	"encoding/binary"
	"fmt"
)

// Version is bumped on any incompatible change; peers must match exactly.
const Version = 2

const (
	magic0    = 'K'
	magic1    = 'V'
	HeaderLen = 8
	// MaxControlLen bounds every non-DATA payload (32k tokens at page 16 is
	// 8 KiB of indices, so this is generous).
	MaxControlLen = 4 << 20
	// MaxDataLen bounds one DATA frame; senders split runs into pieces so
	// heartbeats can interleave and read deadlines stay meaningful.
	MaxDataLen = 8 << 20
	// DataHeaderLen is the fixed part of a DATA payload before the bytes.
	DataHeaderLen = 12
)

// Type identifies a frame.
type Type uint8

const (
	_ Type = iota + 1 // 1 was the pool protocol's HELLO
	TXferReq
	TData
	TDone
	TAbort
	THeartbeat
	TMemHello
	TMemRegionsReq
	TMemRegions
	TMemFence
	TMemFenceAck
	TMemStageReq
	TMemStageRing
	TMemStaged
	TMemStageFree
	TMemClient
	lastType = TMemClient
)

var typeNames = [...]string{TXferReq: "XFER_REQ", TData: "DATA", TDone: "DONE", TAbort: "ABORT", THeartbeat: "HEARTBEAT",
	TMemHello: "MEM_HELLO", TMemRegionsReq: "MEM_REGIONS_REQ", TMemRegions: "MEM_REGIONS", TMemFence: "MEM_FENCE",
	TMemFenceAck: "MEM_FENCE_ACK", TMemStageReq: "MEM_STAGE_REQ", TMemStageRing: "MEM_STAGE_RING",
	TMemStaged: "MEM_STAGED", TMemStageFree: "MEM_STAGE_FREE", TMemClient: "MEM_CLIENT"}

func (t Type) String() string {
	if int(t) < len(typeNames) && typeNames[t] != "" {
		return typeNames[t]
	}
	return fmt.Sprintf("Type(%d)", uint8(t))
}

// Msg is one decoded frame.
type Msg interface {
	Type() Type
	encode(e *Enc)
}

// RegionKind tells KV buffers (indexed by page) from aux buffers (indexed by
// the request's aux slot).
type RegionKind uint8

const (
	KindKV RegionKind = iota + 1
	KindAux
)

// XferReq asks the prefill side to move a room's pages into DstPages (in
// prompt order) and the aux item into AuxSlot (-1: none) of the decode
// engine's buffers Bufs, in its registered memory: buffer i receives the
// prefill's buffer i. PageSize and Dtype must match the prefill's.
type XferReq struct {
	Room     uint64
	AuxSlot  int32
	PageSize uint32
	Dtype    string
	Bufs     []RoomBuf
	DstPages []uint32
}

// RoomBuf is one buffer of an engine's KV layout: Items items (pages, or
// aux slots) of ItemLen bytes from engine address Addr.
type RoomBuf struct {
	Kind    RegionKind
	Addr    uint64
	ItemLen uint32
	Items   uint32
}

// Data precedes N raw bytes destined for Region at Offset (tcp transport).
type Data struct {
	Region uint32
	Offset uint64
	N      uint32
}

// Status of a finished chunk.
type Status uint8

const (
	StatusOK Status = iota
	StatusFailed
)

// Done reports that chunk Chunk of Room is complete at the target. Nanos is
// the time the sender spent moving this chunk (post to flush), so the
// receiver can report pure transfer time apart from waiting for prefill.
type Done struct {
	Room   uint64
	Chunk  uint32
	Last   bool
	Status Status
	Pages  uint32
	Bytes  uint64
	Nanos  uint64
}

// Abort fails a room on the other side.
type Abort struct {
	Room   uint64
	Reason string
}

// Heartbeat proves the peer is alive.
type Heartbeat struct{ Seq uint64 }

func (*XferReq) Type() Type   { return TXferReq }
func (*Data) Type() Type      { return TData }
func (*Done) Type() Type      { return TDone }
func (*Abort) Type() Type     { return TAbort }
func (*Heartbeat) Type() Type { return THeartbeat }

func (m *XferReq) encode(e *Enc) {
	e.U64(m.Room)
	e.I32(m.AuxSlot)
	e.U32(m.PageSize)
	e.String(m.Dtype)
	e.U32(uint32(len(m.Bufs)))
	for _, b := range m.Bufs {
		e.U8(uint8(b.Kind))
		e.U64(b.Addr)
		e.U32(b.ItemLen)
		e.U32(b.Items)
	}
	e.U32s(m.DstPages)
}

func (m *Data) encode(e *Enc) {
	e.U32(m.Region)
	e.U64(m.Offset)
}

func (m *Done) encode(e *Enc) {
	e.U64(m.Room)
	e.U32(m.Chunk)
	e.Bool(m.Last)
	e.U8(uint8(m.Status))
	e.U32(m.Pages)
	e.U64(m.Bytes)
	e.U64(m.Nanos)
}

func (m *Abort) encode(e *Enc) {
	e.U64(m.Room)
	e.Text(m.Reason)
}

func (m *Heartbeat) encode(e *Enc) { e.U64(m.Seq) }

// Decode parses a non-DATA payload of type t.
func Decode(t Type, p []byte) (Msg, error) {
	d := Dec{B: p}
	var m Msg
	switch t {
	case TXferReq:
		x := &XferReq{Room: d.U64(), AuxSlot: d.I32(), PageSize: d.U32(), Dtype: d.String()}
		n := d.U32()
		if n > maxRegions {
			d.failf("%d buffers", n)
		}
		for i := uint32(0); i < n && d.Err == nil; i++ {
			b := RoomBuf{Kind: RegionKind(d.U8()), Addr: d.U64(), ItemLen: d.U32(), Items: d.U32()}
			if d.Err == nil && (b.Kind != KindKV && b.Kind != KindAux || b.ItemLen == 0) {
				d.failf("bad buffer %d", i)
			}
			x.Bufs = append(x.Bufs, b)
		}
		x.DstPages = d.U32s()
		m = x
	case TDone:
		dn := &Done{Room: d.U64(), Chunk: d.U32(), Last: d.Bool(), Status: Status(d.U8()), Pages: d.U32(), Bytes: d.U64(), Nanos: d.U64()}
		if d.Err == nil && dn.Status > StatusFailed {
			d.failf("status %d", dn.Status)
		}
		m = dn
	case TAbort:
		m = &Abort{Room: d.U64(), Reason: d.String()}
	case THeartbeat:
		m = &Heartbeat{Seq: d.U64()}
	default:
		m = decodeMem(t, &d)
	}
	if err := d.End(); err != nil {
		return nil, fmt.Errorf("%s: %w", t, err)
	}
	return m, nil
}

// AppendFrame appends m's whole frame (header and payload) to b. DATA frames
// get only their header: the bytes follow separately.
func AppendFrame(b []byte, m Msg) []byte {
	start := len(b)
	b = append(b, magic0, magic1, Version, byte(m.Type()), 0, 0, 0, 0)
	e := Enc{B: b}
	m.encode(&e)
	n := len(e.B) - start - HeaderLen
	if d, ok := m.(*Data); ok {
		n += int(d.N)
	}
	binary.LittleEndian.PutUint32(e.B[start+4:], uint32(n))
	return e.B
}

// ParseHeader checks a frame header and returns its type and payload length.
func ParseHeader(h []byte) (Type, uint32, error) {
	if len(h) < HeaderLen {
		return 0, 0, fmt.Errorf("%w: short header", ErrMalformed)
	}
	if h[0] != magic0 || h[1] != magic1 {
		return 0, 0, fmt.Errorf("%w: bad magic", ErrMalformed)
	}
	if h[2] != Version {
		return 0, 0, fmt.Errorf("%w: version %d, want %d", ErrMalformed, h[2], Version)
	}
	t := Type(h[3])
	n := binary.LittleEndian.Uint32(h[4:])
	switch {
	case t < TXferReq || t > lastType:
		return 0, 0, fmt.Errorf("%w: unknown type %d", ErrMalformed, h[3])
	case t == TData && (n < DataHeaderLen || n > DataHeaderLen+MaxDataLen):
		return 0, 0, fmt.Errorf("%w: DATA length %d", ErrMalformed, n)
	case t != TData && n > MaxControlLen:
		return 0, 0, fmt.Errorf("%w: %s length %d", ErrMalformed, t, n)
	}
	return t, n, nil
}
