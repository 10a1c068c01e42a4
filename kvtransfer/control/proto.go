// Package control is the Unix-socket API between an engine and its kvproxy.
//
// Engine-memory API (the engine owns its memory, Mooncake-style): Hello
// (the kvproxy's peer address, which names it to other engines),
// RegisterMemory (a memfd of the engine's pages travels as SCM_RIGHTS with
// the frame), UnregisterMemory, Write (src/dst/len triples of engine
// addresses, answered once the bytes are remotely complete), WritePages
// (the same for page-granular KV: buffers × page pairs, so a write of n
// pages in every layer is 24 bytes a buffer and 8 a page instead of 24 a
// page in each buffer), Probe, DirectRoute (may the engine send its small
// host writes to this peer's kvproxy itself: kvtransfer/directwrite.go).
// Hello's reply lists the optional ops this kvproxy serves (Features), so
// a client can fall back to Write.
//
// Room API on top (SGLang's KVSender/KVReceiver): RoomLayout (where the
// engine's KV buffers lie in the memory it registered), decode Expect,
// prefill Send, Poll (optionally waiting for the end), Abort.
//
// Everything a connection registered is dropped when it closes, and its
// unfinished rooms are aborted.
//
// Frame: u32 LE length, then op (u8), request id (u64), body. Replies echo
// op and id and carry ok (bool), error text and a body. Requests on one
// connection may be answered out of order (a waiting Poll does not hold up
// the others).
package control

import (
	"encoding/binary"
	"fmt"

	"github.com/pdrouter/pdrouter/kvtransfer"
	"github.com/pdrouter/pdrouter/kvtransfer/rooms"
	"github.com/pdrouter/pdrouter/kvtransfer/wire"
)

// Op is a control operation.
type Op uint8

const (
	_ Op = iota + 1 // 1 was the kvproxy-allocated pool's Register
	OpExpect
	OpSend
	OpPoll
	OpAbort
	OpHello
	OpRegisterMemory
	OpUnregisterMemory
	OpWrite
	OpProbe
	OpWritePages
	OpRoomLayout
	OpDirectRoute
)

// Features a kvproxy lists in its Hello reply.
const (
	// FeatureWritePages: it serves OpWritePages.
	FeatureWritePages uint32 = 1 << iota
	// FeatureDirectWrite: it serves OpDirectRoute, and its peers take
	// write-only clients on their peer port.
	FeatureDirectWrite
)

// features is what this kvproxy serves.
const features = FeatureWritePages | FeatureDirectWrite

// maxFrame bounds a control frame: 16 MiB holds a Write of ~700k triples
// (SGLang sends all layers of a chunk in one call).
const maxFrame = 16 << 20

// maxTriples bounds one Write before allocating.
const maxTriples = maxFrame / 24

// Triple is one range of a Write: Len bytes from engine address Src (this
// engine's registered memory) to Dst (the peer engine's).
type Triple = kvtransfer.Triple

// cudaHandleLen is the size of a cudaIpcMemHandle_t.
const cudaHandleLen = 64

// RoomLayout is where the engine's KV buffers lie (see rooms.Layout).
type RoomLayout = rooms.Layout

// RoomBuf is one buffer of a RoomLayout.
type RoomBuf = wire.RoomBuf

// Request is one decoded request. Fields unused by Op are zero.
type Request struct {
	Op        Op
	ID        uint64
	Room      uint64
	Bootstrap string // Expect: bootstrap host:port
	Pages     []uint32
	Aux       int32
	Last      bool       // Send
	Wait      bool       // Poll: block until the room ends
	Reason    string     // Abort
	Layout    RoomLayout // RoomLayout

	// RegisterMemory: Kind, Addr (start of the region in the engine's
	// address space; page-aligned for host memory), Len; cuda also Handle
	// (cudaIpcMemHandle of the allocation) and HandleOffset (Addr minus the
	// allocation's base). UnregisterMemory: Addr.
	Kind         wire.MemKind
	Addr, Len    uint64
	Handle       []byte
	HandleOffset uint64
	// Write, Probe, DirectRoute: the peer kvproxy's peer address (Mooncake's session id).
	Peer    string
	Triples []Triple // Write; a host RegisterMemory's memfd travels as SCM_RIGHTS beside the frame
	// WritePages: Peer and the page write.
	PageWrite kvtransfer.PageWrite
}

// Reply answers a request.
type Reply struct {
	Op  Op
	ID  uint64
	Err string
	// Hello
	Transport string
	// Poll
	State              uint8
	Reason             string
	Pages, Bytes       uint64
	TransferNs, WallNs uint64
	// Hello: this kvproxy's peer address ("host:port"); Transport too;
	// the optional ops it serves (absent from older kvproxies: none).
	PeerAddr string
	Features uint32
	// DirectRoute: Direct, the engine may write small host buffers to the
	// peer itself within WriteTimeoutNs; else Reason says why not.
	Direct         bool
	WriteTimeoutNs uint64
}

func frame(build func(e *wire.Enc)) []byte {
	e := wire.Enc{B: make([]byte, 4, 64)}
	build(&e)
	binary.LittleEndian.PutUint32(e.B, uint32(len(e.B)-4))
	return e.B
}

// EncodeRequest encodes r as one frame.
func EncodeRequest(r *Request) []byte {
	return frame(func(e *wire.Enc) {
		e.U8(uint8(r.Op))
		e.U64(r.ID)
		switch r.Op {
		case OpRoomLayout:
			e.U32(r.Layout.PageSize)
			e.String(r.Layout.Dtype)
			e.U32(uint32(len(r.Layout.Bufs)))
			for _, b := range r.Layout.Bufs {
				e.U8(uint8(b.Kind))
				e.U64(b.Addr)
				e.U32(b.ItemLen)
				e.U32(b.Items)
			}
		case OpExpect:
			e.U64(r.Room)
			e.String(r.Bootstrap)
			e.I32(r.Aux)
			e.U32s(r.Pages)
		case OpSend:
			e.U64(r.Room)
			e.Bool(r.Last)
			e.I32(r.Aux)
			e.U32s(r.Pages)
		case OpPoll:
			e.U64(r.Room)
			e.Bool(r.Wait)
		case OpAbort:
			e.U64(r.Room)
			e.Text(r.Reason)
		case OpRegisterMemory:
			e.U8(uint8(r.Kind))
			e.U64(r.Addr)
			e.U64(r.Len)
			if r.Kind == wire.MemCUDA {
				e.Bytes(r.Handle)
				e.U64(r.HandleOffset)
			}
		case OpUnregisterMemory:
			e.U64(r.Addr)
		case OpWrite:
			e.String(r.Peer)
			e.U32(uint32(len(r.Triples)))
			for _, t := range r.Triples {
				e.U64(t.Src)
				e.U64(t.Dst)
				e.U64(t.Len)
			}
		case OpProbe, OpDirectRoute:
			e.String(r.Peer)
		case OpWritePages:
			e.String(r.Peer)
			w := &r.PageWrite
			e.U32(uint32(len(w.Bufs)))
			for _, b := range w.Bufs {
				e.U64(b.Src)
				e.U64(b.Dst)
				e.U64(b.PageLen)
			}
			e.U32(uint32(len(w.Pairs)))
			for _, p := range w.Pairs {
				e.U32(p.Src)
				e.U32(p.Dst)
			}
		}
	})
}

// DecodeRequest parses one frame body (without the length prefix).
func DecodeRequest(b []byte) (*Request, error) {
	d := wire.Dec{B: b}
	r := &Request{Op: Op(d.U8()), ID: d.U64()}
	switch r.Op {
	case OpRoomLayout:
		r.Layout.PageSize = d.U32()
		r.Layout.Dtype = d.String()
		n := d.U32()
		if n > 4096 {
			return nil, fmt.Errorf("%w: %d buffers", wire.ErrMalformed, n)
		}
		for i := uint32(0); i < n && d.Err == nil; i++ {
			r.Layout.Bufs = append(r.Layout.Bufs, RoomBuf{Kind: wire.RegionKind(d.U8()), Addr: d.U64(), ItemLen: d.U32(), Items: d.U32()})
		}
	case OpExpect:
		r.Room, r.Bootstrap, r.Aux, r.Pages = d.U64(), d.String(), d.I32(), d.U32s()
	case OpSend:
		r.Room, r.Last, r.Aux, r.Pages = d.U64(), d.Bool(), d.I32(), d.U32s()
	case OpPoll:
		r.Room, r.Wait = d.U64(), d.Bool()
	case OpAbort:
		r.Room, r.Reason = d.U64(), d.String()
	case OpHello:
	case OpRegisterMemory:
		r.Kind, r.Addr, r.Len = wire.MemKind(d.U8()), d.U64(), d.U64()
		switch {
		case d.Err != nil:
		case r.Kind == wire.MemCUDA:
			r.Handle, r.HandleOffset = d.Bytes(), d.U64()
			if d.Err == nil && len(r.Handle) != cudaHandleLen {
				return nil, fmt.Errorf("%w: cuda handle of %d bytes, want %d", wire.ErrMalformed, len(r.Handle), cudaHandleLen)
			}
		case r.Kind != wire.MemHost:
			return nil, fmt.Errorf("%w: memory kind %d", wire.ErrMalformed, r.Kind)
		}
	case OpUnregisterMemory:
		r.Addr = d.U64()
	case OpWrite:
		r.Peer = d.String()
		n := d.U32()
		if d.Err == nil && (n > maxTriples || uint64(n)*24 > uint64(len(d.B))) {
			return nil, fmt.Errorf("%w: %d triples in %d bytes", wire.ErrMalformed, n, len(d.B))
		}
		if d.Err == nil {
			// One bounds check for the lot: big GPU writes carry 10^5 triples.
			raw := d.B[:n*24]
			d.B = d.B[n*24:]
			r.Triples = make([]Triple, n)
			for i := range r.Triples {
				o := raw[24*i : 24*i+24]
				r.Triples[i] = Triple{Src: binary.LittleEndian.Uint64(o), Dst: binary.LittleEndian.Uint64(o[8:]), Len: binary.LittleEndian.Uint64(o[16:])}
			}
		}
	case OpProbe, OpDirectRoute:
		r.Peer = d.String()
	case OpWritePages:
		r.Peer = d.String()
		var err error
		if r.PageWrite, err = decodePageWrite(&d); err != nil {
			return nil, err
		}
	default:
		if d.Err == nil {
			return nil, fmt.Errorf("%w: op %d", wire.ErrMalformed, r.Op)
		}
	}
	if err := d.End(); err != nil {
		return nil, err
	}
	return r, nil
}

// decodePageWrite reads a WritePages body after the peer: u32 buffer count,
// (src, dst, page length) u64s each, u32 pair count, (src, dst) u32 page
// indexes each. Counts are checked against the bytes left before anything
// is allocated.
func decodePageWrite(d *wire.Dec) (kvtransfer.PageWrite, error) {
	var w kvtransfer.PageWrite
	nb := d.U32()
	if d.Err != nil {
		return w, nil // End reports it
	}
	if uint64(nb)*24 > uint64(len(d.B)) {
		return w, fmt.Errorf("%w: %d page buffers in %d bytes", wire.ErrMalformed, nb, len(d.B))
	}
	raw := d.B[:nb*24]
	d.B = d.B[nb*24:]
	w.Bufs = make([]kvtransfer.PageBuf, nb)
	for i := range w.Bufs {
		o := raw[24*i : 24*i+24]
		w.Bufs[i] = kvtransfer.PageBuf{Src: binary.LittleEndian.Uint64(o), Dst: binary.LittleEndian.Uint64(o[8:]), PageLen: binary.LittleEndian.Uint64(o[16:])}
	}
	np := d.U32()
	if d.Err != nil {
		return w, nil
	}
	if uint64(np)*8 > uint64(len(d.B)) || uint64(nb)*uint64(np) > kvtransfer.MaxPageWrite {
		return w, fmt.Errorf("%w: %d page pairs in %d bytes for %d buffers", wire.ErrMalformed, np, len(d.B), nb)
	}
	raw = d.B[:np*8]
	d.B = d.B[np*8:]
	w.Pairs = make([]kvtransfer.PagePair, np)
	for i := range w.Pairs {
		w.Pairs[i] = kvtransfer.PagePair{Src: binary.LittleEndian.Uint32(raw[8*i:]), Dst: binary.LittleEndian.Uint32(raw[8*i+4:])}
	}
	return w, nil
}

// EncodeReply encodes r as one frame.
func EncodeReply(r *Reply) []byte {
	return frame(func(e *wire.Enc) {
		e.U8(uint8(r.Op))
		e.U64(r.ID)
		e.Text(r.Err)
		switch r.Op {
		case OpHello:
			e.String(r.PeerAddr)
			e.String(r.Transport)
			e.U32(r.Features)
		case OpPoll:
			e.U8(r.State)
			e.Text(r.Reason)
			e.U64(r.Pages)
			e.U64(r.Bytes)
			e.U64(r.TransferNs)
			e.U64(r.WallNs)
		case OpDirectRoute:
			e.Bool(r.Direct)
			e.U64(r.WriteTimeoutNs)
			e.Text(r.Reason)
		}
	})
}

// DecodeReply parses one reply body.
func DecodeReply(b []byte) (*Reply, error) {
	d := wire.Dec{B: b}
	r := &Reply{Op: Op(d.U8()), ID: d.U64(), Err: d.String()}
	switch r.Op {
	case OpHello:
		r.PeerAddr, r.Transport = d.String(), d.String()
		if d.Err == nil && len(d.B) > 0 {
			r.Features = d.U32()
		}
	case OpPoll:
		r.State, r.Reason = d.U8(), d.String()
		r.Pages, r.Bytes, r.TransferNs, r.WallNs = d.U64(), d.U64(), d.U64(), d.U64()
	case OpDirectRoute:
		r.Direct, r.WriteTimeoutNs, r.Reason = d.Bool(), d.U64(), d.String()
	}
	if err := d.End(); err != nil {
		return nil, err
	}
	return r, nil
}

// splitFrame returns the first complete frame body in b and the rest, or
// nil if b holds no complete frame yet.
func splitFrame(b []byte) (body, rest []byte, err error) {
	if len(b) < 4 {
		return nil, b, nil
	}
	n := binary.LittleEndian.Uint32(b)
	if n > maxFrame {
		return nil, nil, fmt.Errorf("%w: control frame of %d bytes", wire.ErrMalformed, n)
	}
	if uint32(len(b)-4) < n {
		return nil, b, nil
	}
	return b[4 : 4+n], b[4+n:], nil
}
