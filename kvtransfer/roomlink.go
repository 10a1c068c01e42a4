package kvtransfer

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/pdrouter/pdrouter/kvtransfer/wire"
)

// roomLink is what rooms keep of one memory-plane link they use: the rooms
// matched over it, the ordered queue of what they send (messages and chunk
// jobs, so a chunk's DONE follows its data and an ABORT its XFER_REQ), and
// liveness. Two goroutines per link: the sender and the heartbeat, which
// also closes a link whose peer sent nothing for two intervals (a dead
// peer fails all its rooms at once).
type roomLink struct {
	e *Rooms
	l *memLink

	rooms map[uint64]*room // matched over this link; guarded by e.mu
	lost  bool             // its rooms were failed; guarded by e.mu

	qmu   sync.Mutex
	queue []item
	wake  chan struct{}

	since time.Time // when rooms started using the link

	ctx    context.Context // ends when the link is lost or rooms close
	cancel context.CancelFunc
	done   chan struct{} // closed by stop
	once   sync.Once
}

// item is one entry of a link's send queue: a message, or a job. sent,
// if set, is closed once the message is written.
type item struct {
	msg  wire.Msg
	job  *chunkJob
	sent chan struct{}
}

// roomLinkLocked returns l's roomLink, starting it on first use; nil once
// rooms are closed.
func (e *Rooms) roomLinkLocked(l *memLink) *roomLink {
	if rl := e.links[l]; rl != nil {
		return rl
	}
	if e.closed || l.isClosed() {
		return nil
	}
	ctx, cancel := context.WithCancel(e.ctx)
	rl := &roomLink{e: e, l: l, rooms: map[uint64]*room{}, wake: make(chan struct{}, 1), ctx: ctx, cancel: cancel, done: make(chan struct{})}
	rl.since = time.Now()
	e.links[l] = rl
	e.wg.Add(2)
	go rl.send()
	go rl.heartbeat()
	return rl
}

func (rl *roomLink) enqueue(it item) {
	rl.qmu.Lock()
	rl.queue = append(rl.queue, it)
	rl.qmu.Unlock()
	select {
	case rl.wake <- struct{}{}:
	default:
	}
}

// stop ends the link's goroutines (not the link).
func (rl *roomLink) stop() {
	rl.once.Do(func() {
		close(rl.done)
		rl.cancel()
	})
}

func (rl *roomLink) send() {
	defer rl.e.wg.Done()
	for {
		select {
		case <-rl.done:
			return
		case <-rl.wake:
		}
		rl.qmu.Lock()
		items := rl.queue
		rl.queue = nil
		rl.qmu.Unlock()
		for _, it := range items {
			var err error
			if it.job != nil {
				err = it.job.run(rl)
			} else {
				err = rl.l.conn.Write(it.msg)
			}
			if it.sent != nil {
				close(it.sent)
			}
			if err != nil {
				rl.l.close(err)
				return
			}
		}
	}
}

func (rl *roomLink) heartbeat() {
	defer rl.e.wg.Done()
	hb := rl.e.cfg.Heartbeat
	t := time.NewTicker(hb)
	defer t.Stop()
	var seq uint64
	for {
		select {
		case <-rl.done:
			return
		case <-t.C:
		}
		// Any frame counts: a long DATA stream holds up the peer's heartbeats.
		last := time.Unix(0, rl.l.lastRead.Load())
		if last.Before(rl.since) {
			last = rl.since
		}
		if silent := time.Since(last); silent > 2*hb {
			rl.l.close(fmt.Errorf("peer silent for %v", silent.Round(time.Millisecond)))
			return
		}
		seq++
		if err := rl.l.conn.Write(&wire.Heartbeat{Seq: seq}); err != nil {
			rl.l.close(err)
			return
		}
	}
}

// roomMsg hands a room message the link l read to the room layer.
func (p *MemoryPlane) roomMsg(l *memLink, m wire.Msg) error {
	e := p.rooms.Load()
	if e == nil {
		if _, ok := m.(*wire.Heartbeat); ok {
			return nil
		}
		return fmt.Errorf("%w: %s, and this kvproxy serves no rooms", wire.ErrMalformed, m.Type())
	}
	e.mu.Lock()
	rl := e.roomLinkLocked(l)
	e.mu.Unlock()
	if rl == nil {
		return nil // closing
	}
	switch m := m.(type) {
	case *wire.XferReq:
		e.onXferReq(rl, m)
	case *wire.Done:
		e.onDone(rl, m)
	case *wire.Abort:
		e.onAbort(rl, m)
	}
	return nil
}

// roomLinkLost fails every room matched over l, which closed.
func (p *MemoryPlane) roomLinkLost(l *memLink, cause error) {
	e := p.rooms.Load()
	if e == nil {
		return
	}
	e.mu.Lock()
	rl := e.links[l]
	if rl != nil {
		delete(e.links, l)
		rl.lost = true
		for _, r := range rl.rooms {
			e.failLocked(r, "peer lost: "+cause.Error(), false)
		}
	}
	e.mu.Unlock()
	if rl != nil {
		rl.stop()
	}
}

// writeRoom moves a room's chunk from s's memory into the engine behind l:
// the page write (on a GPU, without expanding it), then the aux ranges.
func (s *MemorySession) writeRoom(ctx context.Context, l *memLink, w *PageWrite, aux []Triple) error {
	if err := w.Check(); err != nil {
		return err
	}
	peer := l.remote.ListenAddr
	deadline := writeDeadline(s.p.cfg.WriteTimeout, []Triple{{Len: w.Bytes()}})
	return s.write(ctx, peer, deadline, func(ctx context.Context) error {
		ts := w.mergedTriples()
		if len(ts) > 0 && s.p.gpu.holds(ts[:1]) {
			if err := s.p.gpu.writePages(ctx, s.p, l, w); err != nil {
				return err
			}
			ts = nil
		}
		return s.p.writeLink(ctx, l, append(ts, aux...))
	})
}
