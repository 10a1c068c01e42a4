package rooms

import (
	"context"
	"errors"
	"fmt"
	"time"

	"go.uber.org/zap"

	"github.com/pdrouter/pdrouter/kvtransfer"
	"github.com/pdrouter/pdrouter/kvtransfer/wire"
)

// State is SGLang's KVPoll, with the same numbers.
type State int32

const (
	Failed State = iota
	Bootstrapping
	WaitingForInput
	Transferring
	Success
)

var stateNames = [...]string{Failed: "Failed", Bootstrapping: "Bootstrapping", WaitingForInput: "WaitingForInput", Transferring: "Transferring", Success: "Success"}

func (s State) String() string {
	if s >= 0 && int(s) < len(stateNames) {
		return stateNames[s]
	}
	return fmt.Sprintf("State(%d)", int32(s))
}

// Terminal reports whether no further transition can happen.
func (s State) Terminal() bool { return s == Failed || s == Success }

// Status is a room's state and what moved so far.
type Status struct {
	State  State
	Reason string // why it failed
	Pages  uint64
	Bytes  uint64
	// Transfer is the time spent moving data (post to flush, summed over
	// chunks, as measured by the sender); Wall runs from XFER_REQ to the end.
	Transfer time.Duration
	Wall     time.Duration
}

// Errors returned by the room API.
var (
	ErrUnknownRoom = errors.New("unknown room")
	ErrRoomExists  = errors.New("room already exists")
	ErrRoomDone    = errors.New("room already finished")
)

// event is what moves a room along the KVPoll ladder. Both roles climb the
// same ladder; an event means the matching thing on each side.
type event uint8

const (
	// matched: prefill, XFER_REQ arrived; decode, XFER_REQ sent.
	matched event = iota
	// moved: prefill, a chunk went to the peer's writer; decode, a
	// chunk's DONE arrived.
	moved
	// completed: the last chunk is complete (prefill, its DONE is sent;
	// decode, it arrived).
	completed
	// failed: timeout, abort, lost peer, bad chunk, engine closed.
	failed
)

// next is the state ev takes a room in s to; ok is false when ev cannot
// happen in s. Every room starts Bootstrapping and every non-terminal state
// can fail, so every room ends.
func next(s State, ev event) (to State, ok bool) {
	switch {
	case s.Terminal():
		return s, false
	case ev == failed:
		return Failed, true
	case ev == matched && s == Bootstrapping:
		return WaitingForInput, true
	case ev == moved && (s == WaitingForInput || s == Transferring):
		return Transferring, true
	case ev == completed && s == Transferring:
		return Success, true
	}
	return s, false
}

// room is what both roles' rooms hold. Everything is guarded by Rooms.mu.
type room struct {
	id    uint64
	role  string // prefill or decode: the side of the transfer it is on
	st    Status
	link  *roomLink // the link it is matched over, set with matched
	start time.Time // when it was matched
	timer *time.Timer
	gen   int // timer generation, so a stale timer cannot fire
	done  chan struct{}
}

// prefillRoom sends: chunks Sent before XFER_REQ wait in queued, then each
// chunk is mapped onto the next of the decode's pages.
type prefillRoom struct {
	room
	dst       []uint32       // the decode's pages, from XFER_REQ
	dstAux    int32          // the decode's aux slot (-1: none)
	dstBufs   []wire.RoomBuf // the decode's buffers, from XFER_REQ
	queued    []chunk
	assigned  int  // dst pages given to chunks so far
	lastSeen  bool // the last chunk was Sent
	nextChunk uint32
}

// decodeRoom receives into pages of our engine's buffers.
type decodeRoom struct {
	room
	boot   string // bootstrap address of the prefill engine
	layout *Layout
	pages  []uint32
	aux    int32  // aux slot (-1: none)
	expect uint32 // next chunk whose DONE is due
}

type chunk struct {
	src    []uint32
	last   bool
	srcAux int32
}

type tomb struct {
	st  Status
	end time.Time
}

// roomLocked finds an unfinished room of either role.
func (e *Rooms) roomLocked(id uint64) *room {
	if r := e.prefills[id]; r != nil {
		return &r.room
	}
	if r := e.decodes[id]; r != nil {
		return &r.room
	}
	return nil
}

// admitLocked checks that a new room id may start.
func (e *Rooms) admitLocked(id uint64) error {
	if e.closed {
		return kvtransfer.ErrClosed
	}
	if e.roomLocked(id) != nil {
		return ErrRoomExists
	}
	if _, ok := e.tombs[id]; ok {
		return ErrRoomDone
	}
	return nil
}

func (e *Rooms) newRoom(id uint64, role string) room {
	e.m.roomsActive.WithLabelValues(role).Inc()
	return room{id: id, role: role, st: Status{State: Bootstrapping}, done: make(chan struct{})}
}

// stepLocked applies ev to r and reports whether it was legal (an illegal
// event leaves r as it was). Entering WaitingForInput starts the waiting
// timeout; Success and Failed end the room.
func (e *Rooms) stepLocked(r *room, ev event, reason string) bool {
	to, ok := next(r.st.State, ev)
	if !ok {
		return false
	}
	switch to {
	case Success, Failed:
		e.finishLocked(r, to, reason)
	case WaitingForInput:
		r.st.State, r.start = to, time.Now()
		e.armLocked(r, e.cfg.WaitingTimeout, "waiting timeout")
	default:
		r.st.State = to
	}
	return true
}

// matchLocked binds r to the link it transfers over.
func (e *Rooms) matchLocked(r *room, rl *roomLink) bool {
	if !e.stepLocked(r, matched, "") {
		return false
	}
	r.link = rl
	rl.rooms[r.id] = r
	if rl.lost {
		// A room matched after its link's rooms failed would wait out its
		// timeout over a dead link.
		e.failLocked(r, "peer lost before the room matched", false)
	}
	return true
}

// armLocked replaces the room's timer.
func (e *Rooms) armLocked(r *room, d time.Duration, why string) {
	if r.timer != nil {
		r.timer.Stop()
	}
	r.gen++
	gen := r.gen
	r.timer = time.AfterFunc(d, func() {
		e.mu.Lock()
		defer e.mu.Unlock()
		if r.gen == gen {
			e.failLocked(r, why, true)
		}
	})
}

// finishLocked ends r: it leaves the room table (its pages are the engine's
// to free once it sees the final state) and becomes a tombstone.
func (e *Rooms) finishLocked(r *room, s State, reason string) {
	if r.timer != nil {
		r.timer.Stop()
	}
	r.gen++
	if r.st.State != Bootstrapping {
		delete(r.link.rooms, r.id)
	}
	r.st.State, r.st.Reason = s, reason
	if !r.start.IsZero() {
		r.st.Wall = time.Since(r.start)
	}
	delete(e.prefills, r.id) // it is in one of them
	delete(e.decodes, r.id)
	e.tombs[r.id] = tomb{st: r.st, end: time.Now()}
	close(r.done)
	e.m.roomsActive.WithLabelValues(r.role).Dec()
	e.m.roomsDone.WithLabelValues(r.role, s.String()).Inc()
	if s == Success {
		e.m.duration.WithLabelValues(r.role).Observe(r.st.Transfer.Seconds())
	}
	if s == Failed {
		e.log.Info("room failed", zap.Uint64("room", r.id), zap.String("role", r.role), zap.String("reason", reason))
	}
}

// failLocked fails r; with notify, a matched room's peer is told with an
// ABORT.
func (e *Rooms) failLocked(r *room, reason string, notify bool) {
	wasMatched := r.st.State != Bootstrapping
	if e.stepLocked(r, failed, reason) && notify && wasMatched {
		r.link.enqueue(item{msg: &wire.Abort{Room: r.id, Reason: reason}})
	}
}

// checkLocked refuses pages or an aux slot outside our layout.
func (e *Rooms) checkLocked(pages []uint32, aux int32) error {
	if e.closed {
		return kvtransfer.ErrClosed
	}
	if e.layout == nil || e.owner.Gone() {
		return ErrNoLayout // none, or its engine left with its memory
	}
	return checkPages(e.layout, pages, aux)
}

// Expect (decode) announces that room's KV must land in dst pages (in prompt
// order) and its aux item in auxSlot (-1: none), sent by the prefill engine
// behind bootstrapAddr.
func (e *Rooms) Expect(id uint64, bootstrapAddr string, dst []uint32, auxSlot int32) error {
	if e.cfg.Resolve == nil {
		return errors.New("rooms: no bootstrap resolver configured")
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if err := e.checkLocked(dst, auxSlot); err != nil {
		return err
	}
	if err := e.admitLocked(id); err != nil {
		return err
	}
	r := &decodeRoom{room: e.newRoom(id, "decode"), boot: bootstrapAddr, pages: dst, aux: auxSlot, layout: e.layout}
	e.decodes[id] = r
	e.armLocked(&r.room, e.cfg.BootstrapTimeout, "bootstrap timeout")
	e.wg.Go(func() { e.bootstrap(r) })
	return nil
}

// bootstrap finds (or connects) the link to the room's prefill kvproxy and
// sends XFER_REQ.
func (e *Rooms) bootstrap(r *decodeRoom) {
	ctx, cancel := context.WithTimeout(e.ctx, e.cfg.BootstrapTimeout)
	defer cancel()
	go func() { // stop resolving/dialing as soon as the room ends
		select {
		case <-r.done:
			cancel()
		case <-ctx.Done():
		}
	}()
	var l kvtransfer.Link
	addr, err := e.cfg.Resolve(ctx, r.boot)
	if err == nil {
		l, err = e.p.Link(ctx, addr)
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if err != nil {
		e.failLocked(&r.room, "bootstrap: "+err.Error(), false)
		return
	}
	rl := e.roomLinkLocked(l)
	if rl == nil {
		e.failLocked(&r.room, "bootstrap: "+kvtransfer.ErrClosed.Error(), false)
		return
	}
	if e.matchLocked(&r.room, rl) {
		rl.enqueue(item{msg: &wire.XferReq{Room: r.id, AuxSlot: r.aux, PageSize: r.layout.PageSize, Dtype: r.layout.Dtype,
			Bufs: r.layout.Bufs, DstPages: r.pages}})
	}
}

// Send (prefill) queues one chunk of room's pages; last marks the final
// chunk, whose aux item srcAux (-1: none) goes with it.
func (e *Rooms) Send(id uint64, src []uint32, last bool, srcAux int32) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if err := e.checkLocked(src, srcAux); err != nil {
		return err
	}
	if e.decodes[id] != nil {
		return fmt.Errorf("room %d is a decode room", id)
	}
	r := e.prefills[id]
	if r == nil {
		if err := e.admitLocked(id); err != nil {
			return err
		}
		r = e.newPrefillLocked(id)
		e.armLocked(&r.room, e.cfg.BootstrapTimeout, "bootstrap timeout")
	}
	if r.lastSeen {
		return fmt.Errorf("room %d: Send after the last chunk", id)
	}
	r.lastSeen = last
	c := chunk{src: src, last: last, srcAux: srcAux}
	if r.st.State == Bootstrapping {
		r.queued = append(r.queued, c)
		return nil
	}
	e.dispatchLocked(r, c)
	return nil
}

func (e *Rooms) newPrefillLocked(id uint64) *prefillRoom {
	r := &prefillRoom{room: e.newRoom(id, "prefill"), dstAux: -1}
	e.prefills[id] = r
	return r
}

// onXferReq matches the decode's request with the prefill room, creating
// it when the prefill engine has not Sent yet, and dispatches what waited.
func (e *Rooms) onXferReq(rl *roomLink, m *wire.XferReq) {
	abort := func(reason string) { rl.enqueue(item{msg: &wire.Abort{Room: m.Room, Reason: reason}}) }
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.layout == nil {
		abort("the prefill engine registered no room layout")
		return
	}
	if err := e.layout.compatible(m); err != nil {
		abort(err.Error())
		return
	}
	r := e.prefills[m.Room]
	if r == nil && e.decodes[m.Room] == nil {
		if err := e.admitLocked(m.Room); err != nil {
			abort(err.Error())
			return
		}
		r = e.newPrefillLocked(m.Room)
	}
	if r == nil || !e.matchLocked(&r.room, rl) {
		abort("duplicate XFER_REQ")
		return
	}
	r.dst, r.dstAux, r.dstBufs = m.DstPages, m.AuxSlot, m.Bufs
	queued := r.queued
	r.queued = nil
	for _, c := range queued {
		if r.st.State.Terminal() {
			break
		}
		e.dispatchLocked(r, c)
	}
}

// dispatchLocked maps a chunk onto the decode's pages and queues the batch.
func (e *Rooms) dispatchLocked(r *prefillRoom, c chunk) {
	end := r.assigned + len(c.src)
	switch {
	case end > len(r.dst):
		e.failLocked(&r.room, fmt.Sprintf("prefill sent %d pages, decode expects %d", end, len(r.dst)), true)
		return
	case c.last && end != len(r.dst):
		e.failLocked(&r.room, fmt.Sprintf("last chunk ends at page %d, decode expects %d", end, len(r.dst)), true)
		return
	}
	dst := r.dst[r.assigned:end]
	r.assigned = end
	j := &chunkJob{r: r, s: e.owner, chunk: r.nextChunk, last: c.last, pages: len(c.src)}
	for i, b := range e.layout.Bufs {
		d := r.dstBufs[i]
		switch {
		case b.Kind == wire.KindKV:
			j.w.Bufs = append(j.w.Bufs, kvtransfer.PageBuf{Src: b.Addr, Dst: d.Addr, PageLen: uint64(b.ItemLen)})
		case c.last && c.srcAux >= 0 && r.dstAux >= 0:
			j.aux = append(j.aux, kvtransfer.Triple{Src: b.Addr + uint64(c.srcAux)*uint64(b.ItemLen), Dst: d.Addr + uint64(r.dstAux)*uint64(d.ItemLen), Len: uint64(b.ItemLen)})
		}
	}
	j.w.Pairs = make([]kvtransfer.PagePair, len(c.src))
	for i, p := range c.src {
		j.w.Pairs[i] = kvtransfer.PagePair{Src: p, Dst: dst[i]}
	}
	e.stepLocked(&r.room, moved, "")
	r.link.enqueue(item{job: j})
	r.nextChunk++
}

// chunkJob is one prefill chunk: a page write of every KV buffer plus the
// aux item with the last chunk, run by the link's sender.
type chunkJob struct {
	r     *prefillRoom
	s     *kvtransfer.MemorySession // the engine whose memory the pages are
	chunk uint32
	last  bool
	pages int
	w     kvtransfer.PageWrite
	aux   []kvtransfer.Triple
}

// run moves the chunk, then sends its DONE.
func (j *chunkJob) run(rl *roomLink) error {
	e := rl.e
	e.mu.Lock()
	skip := j.r.st.State.Terminal()
	e.mu.Unlock()
	if skip {
		return nil
	}
	bytes := j.w.Bytes()
	for _, t := range j.aux {
		bytes += t.Len
	}
	t0 := time.Now()
	if err := j.s.WriteOver(rl.ctx, rl.l, &j.w, j.aux); err != nil {
		// The link may be fine (the engine's memory went, a bad page): fail
		// the room and tell the decode, keep the link.
		e.mu.Lock()
		e.failLocked(&j.r.room, "transfer: "+err.Error(), true)
		e.mu.Unlock()
		return nil
	}
	dt := time.Since(t0)
	done := &wire.Done{Room: j.r.id, Chunk: j.chunk, Last: j.last, Pages: uint32(j.pages), Bytes: bytes, Nanos: uint64(dt)}
	if err := rl.l.Send(done); err != nil {
		return err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	j.r.st.Pages += uint64(j.pages)
	j.r.st.Bytes += bytes
	j.r.st.Transfer += dt
	e.m.pages.WithLabelValues("sent").Add(float64(j.pages))
	e.m.bytes.WithLabelValues("sent").Add(float64(bytes))
	if j.last {
		e.stepLocked(&j.r.room, completed, "")
	}
	return nil
}

// onDone accounts one chunk that landed in a decode room.
func (e *Rooms) onDone(rl *roomLink, m *wire.Done) {
	e.mu.Lock()
	defer e.mu.Unlock()
	r := e.decodes[m.Room]
	if r == nil || r.link != rl {
		return
	}
	switch {
	case m.Status != wire.StatusOK:
		e.failLocked(&r.room, "prefill reported a failed chunk", false)
		return
	case m.Chunk != r.expect:
		e.failLocked(&r.room, fmt.Sprintf("chunk %d arrived, expected %d", m.Chunk, r.expect), true)
		return
	}
	r.expect++
	r.st.Pages += uint64(m.Pages)
	r.st.Bytes += m.Bytes
	r.st.Transfer += time.Duration(m.Nanos)
	e.m.pages.WithLabelValues("received").Add(float64(m.Pages))
	e.m.bytes.WithLabelValues("received").Add(float64(m.Bytes))
	e.stepLocked(&r.room, moved, "")
	if m.Last {
		e.stepLocked(&r.room, completed, "")
	}
}

// onAbort fails the room the peer aborted, if it is matched over that link.
func (e *Rooms) onAbort(rl *roomLink, m *wire.Abort) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if r := e.roomLocked(m.Room); r != nil && r.link == rl {
		e.failLocked(r, "aborted by peer: "+m.Reason, false)
	}
}

// Poll returns the room's status; a finished room is remembered for Linger.
func (e *Rooms) Poll(id uint64) (Status, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if r := e.roomLocked(id); r != nil {
		return r.st, nil
	}
	if t, ok := e.tombs[id]; ok {
		return t.st, nil
	}
	return Status{}, ErrUnknownRoom
}

// Wait blocks until the room finishes or ctx ends, then returns its status.
func (e *Rooms) Wait(ctx context.Context, id uint64) (Status, error) {
	e.mu.Lock()
	r := e.roomLocked(id)
	e.mu.Unlock()
	if r != nil {
		select {
		case <-r.done:
		case <-ctx.Done():
		}
	}
	return e.Poll(id)
}

// Abort fails the room here and tells its peer; it returns once the ABORT
// is on the link (or the link is gone), so an engine that aborts then
// leaves does not lose it with the link.
func (e *Rooms) Abort(id uint64, reason string) error {
	e.mu.Lock()
	r := e.roomLocked(id)
	if r == nil {
		_, done := e.tombs[id]
		e.mu.Unlock()
		if done {
			return nil
		}
		return ErrUnknownRoom
	}
	reason = "aborted: " + reason
	rl, matched := r.link, r.st.State != Bootstrapping
	e.failLocked(r, reason, false)
	var sent chan struct{}
	if matched {
		sent = make(chan struct{})
		rl.enqueue(item{msg: &wire.Abort{Room: id, Reason: reason}, sent: sent})
	}
	e.mu.Unlock()
	if sent != nil {
		t := time.NewTimer(e.p.WriteTimeout())
		defer t.Stop()
		select {
		case <-sent:
		case <-rl.ctx.Done():
		case <-t.C:
		}
	}
	return nil
}

// failAllLocked fails every unfinished room (the engine is closing).
func (e *Rooms) failAllLocked(reason string) {
	for _, r := range e.prefills {
		e.failLocked(&r.room, reason, true)
	}
	for _, r := range e.decodes {
		e.failLocked(&r.room, reason, true)
	}
}
