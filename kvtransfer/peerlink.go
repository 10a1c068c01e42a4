package kvtransfer

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/pdrouter/pdrouter/kvtransfer/wire"
)

// The seam the room layer (kvtransfer/rooms) sits on: it shares the one
// link per peer, speaks its messages on it, and moves its chunks with the
// memory plane's page writes.

// Link is one link to a peer kvproxy as the room layer holds it. Links
// compare equal when they are the same link.
type Link struct{ l *memLink }

// Send writes m on the link, in order with the layer's other messages.
func (k Link) Send(m wire.Msg) error { return k.l.conn.Write(m) }

// Close closes the link; every holder learns of it through LinkLost.
func (k Link) Close(cause error) { k.l.close(cause) }

// Closed reports whether the link is gone.
func (k Link) Closed() bool { return k.l.isClosed() }

// LastRead is when the link last read a frame (zero: none yet): any frame
// proves the peer alive, DATA included.
func (k Link) LastRead() time.Time {
	if n := k.l.lastRead.Load(); n != 0 {
		return time.Unix(0, n)
	}
	return time.Time{}
}

// RoomHandler is the layer that owns the room messages (XFER_REQ, DONE,
// ABORT, HEARTBEAT) on the plane's links.
type RoomHandler interface {
	// RoomMsg gets each room message a link reads, from that link's
	// reader, in order; an error closes the link.
	RoomMsg(Link, wire.Msg) error
	// LinkLost is told once that a link closed.
	LinkLost(Link, error)
}

// roomHandler boxes a RoomHandler for an atomic pointer.
type roomHandler struct{ h RoomHandler }

// SetRoomHandler hands the room messages of every link to h: one handler
// per plane.
func (p *MemoryPlane) SetRoomHandler(h RoomHandler) error {
	if !p.rooms.CompareAndSwap(nil, &roomHandler{h}) {
		return errors.New("kvtransfer: the memory plane has a room handler already")
	}
	return nil
}

// ClearRoomHandler removes h, if it is the plane's handler.
func (p *MemoryPlane) ClearRoomHandler(h RoomHandler) {
	if cur := p.rooms.Load(); cur != nil && cur.h == h {
		p.rooms.CompareAndSwap(cur, nil)
	}
}

// roomMsg hands a room message the link l read to the room handler.
func (p *MemoryPlane) roomMsg(l *memLink, m wire.Msg) error {
	rh := p.rooms.Load()
	if rh == nil {
		if _, ok := m.(*wire.Heartbeat); ok {
			return nil
		}
		return fmt.Errorf("%w: %s, and this kvproxy serves no rooms", wire.ErrMalformed, m.Type())
	}
	return rh.h.RoomMsg(Link{l}, m)
}

// roomLinkLost tells the room handler that l closed.
func (p *MemoryPlane) roomLinkLost(l *memLink, cause error) {
	if rh := p.rooms.Load(); rh != nil {
		rh.h.LinkLost(Link{l}, cause)
	}
}

// Link returns the link to the peer kvproxy at addr, dialing it once.
func (p *MemoryPlane) Link(ctx context.Context, addr string) (Link, error) {
	l, err := p.link(ctx, addr)
	if err != nil {
		return Link{}, err
	}
	return Link{l}, nil
}

// WriteTimeout is the plane's bound on one write.
func (p *MemoryPlane) WriteTimeout() time.Duration { return p.cfg.WriteTimeout }

// Owns reports whether s registered [addr, addr+n) (host or GPU memory).
func (p *MemoryPlane) Owns(s *MemorySession, addr, n uint64) bool {
	p.mu.Lock()
	r := p.findLocked(addr, n)
	p.mu.Unlock()
	if r != nil {
		return r.owner == s
	}
	g := p.gpu.find(addr, n)
	return g != nil && g.owner == s
}

// Gone reports whether the session's engine has left (or the plane closed).
func (s *MemorySession) Gone() bool { return s.ctx.Err() != nil }

// WriteOver moves a page write plus the ranges extra from s's memory into
// the engine behind k: a room's chunk and its aux item.
func (s *MemorySession) WriteOver(ctx context.Context, k Link, w *PageWrite, extra []Triple) error {
	return s.writePages(ctx, k.l.remote.ListenAddr, w, extra, func(context.Context) (*memLink, error) { return k.l, nil })
}
