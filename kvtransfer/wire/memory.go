package wire

import "fmt"

// Engine-memory messages, used on the links between kvproxies that move
// bytes between memory the engines registered themselves (control
// OpRegisterMemory/OpWrite), not between pools and pages:
//
//	MEM_HELLO        each side once, dialer first: transport, worker address,
//	                 listen address and the current region table
//	MEM_REGIONS_REQ  "send me your table" (a write's destination was unknown)
//	MEM_REGIONS      the whole table: the answer (Seq of the request) or,
//	                 with Seq 0, pushed after a local region went away
//	MEM_FENCE        tcp transport: after a write's DATA frames
//	MEM_FENCE_ACK    every DATA frame before the fence is in memory (or Err
//	                 says why some were dropped)
//	MEM_STAGE_REQ    a writer (ucx) asks for staging slots of its own at the
//	                 receiver, once per link
//	MEM_STAGE_RING   the answer: the receiver's registered staging ring for
//	                 this link (Slots slots of SlotLen bytes from Addr, RKey)
//	MEM_STAGED       the writer put a chunk into a slot by RMA: scatter its
//	                 pieces, back to back, into their regions. With Slot
//	                 InlineSlot (tcp: no ring) the chunk follows as the next
//	                 frame, one DATA frame of Region 0 (no region's ID)
//	MEM_STAGE_FREE   the receiver scattered a slot: the writer may reuse it
//	MEM_CLIENT       instead of MEM_HELLO: a write-only client (an engine
//	                 writing small host buffers itself, not a kvproxy). It
//	                 is answered with MEM_REGIONS (Seq 0), may then send
//	                 DATA, MEM_FENCE and MEM_REGIONS_REQ only, and is never
//	                 a link: no table pushes, rooms or writes go to it
//
// MEM_STAGED and DATA frames of one write share the same fence: its answer
// comes once every slot before it is scattered.
//
// DATA frames on such a link address a region by its ID (Data.Region) and an
// offset inside it; IDs are never reused, so a stale ID fails instead of
// landing in a newer region at the same address.

// MemKind is where an engine's registered memory lives.
type MemKind uint8

const (
	MemHost MemKind = iota
	MemCUDA
)

func (k MemKind) String() string {
	switch k {
	case MemHost:
		return "host"
	case MemCUDA:
		return "cuda"
	}
	return fmt.Sprintf("MemKind(%d)", uint8(k))
}

// MemRegion is one region of an engine's registered memory as its kvproxy
// advertises it: Base and Len in the engine's address space (what the peer
// engine names as destinations), Addr where the kvproxy mapped it and RKey
// the transport's packed key for that mapping (empty for tcp).
type MemRegion struct {
	ID   uint32
	Kind MemKind
	Base uint64
	Len  uint64
	Addr uint64
	RKey []byte
}

// MemHello opens an engine-memory link.
type MemHello struct {
	Name       string
	Transport  string
	WorkerAddr []byte
	ListenAddr string // where the sender accepts links ("host:port")
	Regions    []MemRegion
}

// MemRegionsReq asks for the peer's region table.
type MemRegionsReq struct{ Seq uint64 }

// MemRegions is a whole region table; Seq answers a request (0: pushed).
type MemRegions struct {
	Seq     uint64
	Regions []MemRegion
}

// MemFence follows a write's DATA frames (tcp transport).
type MemFence struct{ Seq uint64 }

// MemFenceAck answers a fence once every earlier DATA frame is in memory;
// Err is non-empty if some of them could not be placed (and were dropped).
type MemFenceAck struct {
	Seq uint64
	Err string
}

// MemStageReq asks the peer for a staging ring on this link: Slots slots
// of SlotLen bytes (the peer may grant fewer or smaller).
type MemStageReq struct {
	Seq     uint64
	SlotLen uint32
	Slots   uint32
}

// MemStageRing answers a MemStageReq: the ring is registered with the
// transport under RKey (Err non-empty: there is none).
type MemStageRing struct {
	Seq     uint64
	Addr    uint64
	SlotLen uint32
	Slots   uint32
	RKey    []byte
	Err     string
}

// StagedPiece is N bytes of a slot bound for Region at Offset.
type StagedPiece struct {
	Region uint32
	Offset uint64
	N      uint32
}

// InlineSlot: the MEM_STAGED's bytes follow in the next frame.
const InlineSlot = ^uint32(0)

// MemStaged says slot Slot of the receiver's ring holds Pieces back to back.
type MemStaged struct {
	Slot   uint32
	Pieces []StagedPiece
}

// MemStageFree returns slot Slot to the writer.
type MemStageFree struct{ Slot uint32 }

// MemClient opens a write-only client connection; Name is for logs.
type MemClient struct{ Name string }

func (*MemHello) Type() Type      { return TMemHello }
func (*MemRegionsReq) Type() Type { return TMemRegionsReq }
func (*MemRegions) Type() Type    { return TMemRegions }
func (*MemFence) Type() Type      { return TMemFence }
func (*MemFenceAck) Type() Type   { return TMemFenceAck }
func (*MemStageReq) Type() Type   { return TMemStageReq }
func (*MemStageRing) Type() Type  { return TMemStageRing }
func (*MemStaged) Type() Type     { return TMemStaged }
func (*MemStageFree) Type() Type  { return TMemStageFree }
func (*MemClient) Type() Type     { return TMemClient }

func encodeMemRegions(e *Enc, rs []MemRegion) {
	e.U32(uint32(len(rs)))
	for _, r := range rs {
		e.U32(r.ID)
		e.U8(uint8(r.Kind))
		e.U64(r.Base)
		e.U64(r.Len)
		e.U64(r.Addr)
		e.Bytes(r.RKey)
	}
}

func decodeMemRegions(d *Dec) []MemRegion {
	n := d.U32()
	if n > maxRegions {
		d.failf("%d regions", n)
	}
	var rs []MemRegion
	for i := uint32(0); i < n && d.Err == nil; i++ {
		r := MemRegion{ID: d.U32(), Kind: MemKind(d.U8()), Base: d.U64(), Len: d.U64(), Addr: d.U64(), RKey: d.Bytes()}
		if d.Err == nil && (r.Kind > MemCUDA || r.Len == 0 || r.Base+r.Len < r.Base) {
			d.failf("bad memory region %d", i)
		}
		rs = append(rs, r)
	}
	return rs
}

func (m *MemHello) encode(e *Enc) {
	e.String(m.Name)
	e.String(m.Transport)
	e.Bytes(m.WorkerAddr)
	e.String(m.ListenAddr)
	encodeMemRegions(e, m.Regions)
}

func (m *MemRegionsReq) encode(e *Enc) { e.U64(m.Seq) }

func (m *MemRegions) encode(e *Enc) {
	e.U64(m.Seq)
	encodeMemRegions(e, m.Regions)
}

func (m *MemFence) encode(e *Enc) { e.U64(m.Seq) }

func (m *MemFenceAck) encode(e *Enc) {
	e.U64(m.Seq)
	e.Text(m.Err)
}

func (m *MemStageReq) encode(e *Enc) {
	e.U64(m.Seq)
	e.U32(m.SlotLen)
	e.U32(m.Slots)
}

func (m *MemStageRing) encode(e *Enc) {
	e.U64(m.Seq)
	e.U64(m.Addr)
	e.U32(m.SlotLen)
	e.U32(m.Slots)
	e.Bytes(m.RKey)
	e.Text(m.Err)
}

func (m *MemStaged) encode(e *Enc) {
	e.U32(m.Slot)
	e.U32(uint32(len(m.Pieces)))
	for _, p := range m.Pieces {
		e.U32(p.Region)
		e.U64(p.Offset)
		e.U32(p.N)
	}
}

func (m *MemStageFree) encode(e *Enc) { e.U32(m.Slot) }

func (m *MemClient) encode(e *Enc) { e.String(m.Name) }

// maxStagedPieces bounds a MEM_STAGED: a slot holds at most MaxDataLen
// bytes, and pieces under 512 bytes are not worth staging one by one.
const maxStagedPieces = MaxDataLen / 512

// decodeMem parses the engine-memory payloads (see Decode); a bad one
// fails d.
func decodeMem(t Type, d *Dec) Msg {
	switch t {
	case TMemHello:
		return &MemHello{Name: d.String(), Transport: d.String(), WorkerAddr: d.Bytes(), ListenAddr: d.String(), Regions: decodeMemRegions(d)}
	case TMemRegionsReq:
		return &MemRegionsReq{Seq: d.U64()}
	case TMemRegions:
		return &MemRegions{Seq: d.U64(), Regions: decodeMemRegions(d)}
	case TMemFence:
		return &MemFence{Seq: d.U64()}
	case TMemFenceAck:
		return &MemFenceAck{Seq: d.U64(), Err: d.String()}
	case TMemStageReq:
		return &MemStageReq{Seq: d.U64(), SlotLen: d.U32(), Slots: d.U32()}
	case TMemStageRing:
		return &MemStageRing{Seq: d.U64(), Addr: d.U64(), SlotLen: d.U32(), Slots: d.U32(), RKey: d.Bytes(), Err: d.String()}
	case TMemStaged:
		m := &MemStaged{Slot: d.U32()}
		n := d.U32()
		if n > maxStagedPieces {
			d.failf("%d staged pieces", n)
		}
		for i := uint32(0); i < n && d.Err == nil; i++ {
			m.Pieces = append(m.Pieces, StagedPiece{Region: d.U32(), Offset: d.U64(), N: d.U32()})
		}
		return m
	case TMemStageFree:
		return &MemStageFree{Slot: d.U32()}
	case TMemClient:
		return &MemClient{Name: d.String()}
	}
	d.failf("type %s has no control payload", t)
	return nil
}
