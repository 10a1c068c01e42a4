package rooms

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/pdrouter/pdrouter/kvtransfer"
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
	l kvtransfer.Link

	rooms map[uint64]*room // matched over this link; guarded by e.mu
	lost  bool             // its rooms were failed; guarded by e.mu

	qmu   sync.Mutex
	queue []item
	wake  chan struct{}

	since time.Time // when rooms started using the link

	ctx    context.Context // ends when the link is lost or rooms close: stops its goroutines
	cancel context.CancelFunc
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
func (e *Rooms) roomLinkLocked(l kvtransfer.Link) *roomLink {
	if rl := e.links[l]; rl != nil {
		return rl
	}
	if e.closed || l.Closed() {
		return nil
	}
	ctx, cancel := context.WithCancel(e.ctx)
	rl := &roomLink{e: e, l: l, rooms: map[uint64]*room{}, wake: make(chan struct{}, 1), since: time.Now(), ctx: ctx, cancel: cancel}
	e.links[l] = rl
	e.wg.Go(rl.send)
	e.wg.Go(rl.heartbeat)
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

func (rl *roomLink) send() {
	for {
		select {
		case <-rl.ctx.Done():
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
				err = rl.l.Send(it.msg)
			}
			if it.sent != nil {
				close(it.sent)
			}
			if err != nil {
				rl.l.Close(err)
				return
			}
		}
	}
}

func (rl *roomLink) heartbeat() {
	hb := rl.e.cfg.Heartbeat
	t := time.NewTicker(hb)
	defer t.Stop()
	var seq uint64
	for {
		select {
		case <-rl.ctx.Done():
			return
		case <-t.C:
		}
		// Any frame counts: a long DATA stream holds up the peer's heartbeats.
		last := rl.l.LastRead()
		if last.Before(rl.since) {
			last = rl.since
		}
		if silent := time.Since(last); silent > 2*hb {
			rl.l.Close(fmt.Errorf("peer silent for %v", silent.Round(time.Millisecond)))
			return
		}
		seq++
		if err := rl.l.Send(&wire.Heartbeat{Seq: seq}); err != nil {
			rl.l.Close(err)
			return
		}
	}
}

// planeHook is what the memory plane calls: the room messages its links
// read and the links it lost.
type planeHook struct{ e *Rooms }

var _ kvtransfer.RoomHandler = planeHook{}

func (h planeHook) RoomMsg(l kvtransfer.Link, m wire.Msg) error { return h.e.roomMsg(l, m) }
func (h planeHook) LinkLost(l kvtransfer.Link, cause error)     { h.e.linkLost(l, cause) }

// roomMsg hands a room message a link read to its room.
func (e *Rooms) roomMsg(l kvtransfer.Link, m wire.Msg) error {
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

// linkLost fails every room matched over l, which closed.
func (e *Rooms) linkLost(l kvtransfer.Link, cause error) {
	e.mu.Lock()
	rl := e.links[l]
	if rl != nil {
		delete(e.links, l)
		rl.lost = true
		for _, r := range rl.rooms {
			e.failLocked(r, "peer lost: "+cause.Error(), false)
		}
		rl.cancel() // its goroutines end, not the link
	}
	e.mu.Unlock()
}
