// Package kvtransfer moves KV-cache pages from a prefill engine's pool into a
// decode engine's pool, keyed by the router's bootstrap_room, with SGLang's
// KVPoll state ladder. The pool is registered once, each peer's metadata
// (transport address, regions, rkeys) is exchanged once per connection, and
// per room only page indices travel (package wire is the protocol).
//
// The decode side calls Expect (it dials the prefill's engine, found through
// the bootstrap API, and sends XFER_REQ); the prefill side calls Send per
// chunk. Chunks queued before XFER_REQ arrives wait for it. Every room ends
// (Success, Failed, abort, timeout, lost peer) and is then kept only as a
// small tombstone for Linger so late messages cannot resurrect it.
package kvtransfer

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/pdrouter/pdrouter/kvtransfer/shm"
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

func (s State) String() string {
	switch s {
	case Failed:
		return "Failed"
	case Bootstrapping:
		return "Bootstrapping"
	case WaitingForInput:
		return "WaitingForInput"
	case Transferring:
		return "Transferring"
	case Success:
		return "Success"
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
	ErrNoPool      = errors.New("no pool registered")
	ErrClosed      = errors.New("engine closed")
)

// Config configures an Engine. Zero durations take the defaults.
type Config struct {
	Name      string
	Transport Transport
	// Listener accepts decode peers (prefill side); nil: accept none.
	Listener net.Listener
	// Resolve maps a bootstrap address (host:port) to the prefill engine's
	// peer address (decode side).
	Resolve          func(ctx context.Context, bootstrapAddr string) (string, error)
	BootstrapTimeout time.Duration // default 300 s
	WaitingTimeout   time.Duration // default 300 s
	Heartbeat        time.Duration // default 5 s; a peer silent for 2 intervals is dead
	Linger           time.Duration // tombstone lifetime, default 60 s
	Logger           *zap.Logger
	Metrics          *Metrics
}

// Engine is one kvproxy's transfer engine. Safe for concurrent use.
type Engine struct {
	cfg    Config
	log    *zap.Logger
	m      *Metrics
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu      sync.Mutex
	pool    *Pool
	meta    LocalMeta
	rooms   map[uint64]*room
	tombs   map[uint64]tomb
	peers   map[*peer]struct{}
	byAddr  map[string]*peer
	dialing map[string]*dialCall
	closed  bool
}

type tomb struct {
	st  Status
	end time.Time
}

type dialCall struct {
	done chan struct{}
	p    *peer
	err  error
}

type room struct {
	id     uint64
	sender bool
	st     Status
	peer   *peer
	boot   string // decode: bootstrap address
	dst    []uint32
	dstAux int32
	// sender: chunks queued before XFER_REQ, pages assigned so far
	queued    []chunk
	assigned  int
	lastSeen  bool
	nextChunk uint32
	// receiver: next chunk id expected
	expect uint32
	start  time.Time
	timer  *time.Timer
	gen    int // timer generation, so a stale timer cannot fire
	done   chan struct{}
}

type chunk struct {
	src    []uint32
	last   bool
	srcAux int32
}

// New starts an engine (its accept loop and tombstone sweeper).
func New(cfg Config) (*Engine, error) {
	if cfg.Transport == nil {
		return nil, errors.New("kvtransfer: no transport")
	}
	def := func(d *time.Duration, v time.Duration) {
		if *d <= 0 {
			*d = v
		}
	}
	def(&cfg.BootstrapTimeout, 300*time.Second)
	def(&cfg.WaitingTimeout, 300*time.Second)
	def(&cfg.Heartbeat, 5*time.Second)
	def(&cfg.Linger, 60*time.Second)
	if cfg.Logger == nil {
		cfg.Logger = zap.NewNop()
	}
	if cfg.Metrics == nil {
		cfg.Metrics = NewMetrics(nil)
	}
	ctx, cancel := context.WithCancel(context.Background())
	e := &Engine{
		cfg: cfg, log: cfg.Logger, m: cfg.Metrics, ctx: ctx, cancel: cancel,
		rooms: map[uint64]*room{}, tombs: map[uint64]tomb{}, peers: map[*peer]struct{}{},
		byAddr: map[string]*peer{}, dialing: map[string]*dialCall{},
	}
	if cfg.Listener != nil {
		e.wg.Add(1)
		go e.acceptLoop()
	}
	e.wg.Add(1)
	go e.sweep()
	return e, nil
}

// TransportName is the configured transport's name.
func (e *Engine) TransportName() string { return e.cfg.Transport.Name() }

// AllocPool has the transport allocate size bytes of shared memory for the
// pool (see Transport.Alloc).
func (e *Engine) AllocPool(size int) (*shm.Segment, error) { return e.cfg.Transport.Alloc(size) }

// RegisterPool registers the engine's KV pool with the transport; once.
func (e *Engine) RegisterPool(p *Pool) error {
	if err := p.Validate(); err != nil {
		return err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.pool != nil {
		return errors.New("pool already registered")
	}
	meta, err := e.cfg.Transport.Register(p)
	if err != nil {
		return fmt.Errorf("register pool: %w", err)
	}
	e.pool, e.meta = p, meta
	return nil
}

// Pool is the registered pool (nil before RegisterPool).
func (e *Engine) Pool() *Pool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.pool
}

// ActiveRooms counts rooms not finished yet.
func (e *Engine) ActiveRooms() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return len(e.rooms)
}

// Peers counts connected peers.
func (e *Engine) Peers() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return len(e.peers)
}

func (e *Engine) checkPages(pages []uint32, aux int32) error {
	if e.pool == nil {
		return ErrNoPool
	}
	n := uint32(e.pool.Pages())
	for _, p := range pages {
		if p >= n {
			return fmt.Errorf("page %d out of range (pool has %d)", p, n)
		}
	}
	if aux >= 0 && int(aux) >= e.pool.AuxSlots() {
		return fmt.Errorf("aux slot %d out of range (pool has %d)", aux, e.pool.AuxSlots())
	}
	return nil
}

// newRoomLocked creates a room in state s with the timeout for that phase.
func (e *Engine) newRoomLocked(id uint64, sender bool, s State) (*room, error) {
	if e.closed {
		return nil, ErrClosed
	}
	if _, ok := e.rooms[id]; ok {
		return nil, ErrRoomExists
	}
	if _, ok := e.tombs[id]; ok {
		return nil, ErrRoomDone
	}
	r := &room{id: id, sender: sender, st: Status{State: s}, dstAux: -1, done: make(chan struct{})}
	e.rooms[id] = r
	e.m.roomsActive.WithLabelValues(r.role()).Inc()
	if s == Bootstrapping {
		e.armLocked(r, e.cfg.BootstrapTimeout, "bootstrap timeout")
	} else {
		e.armLocked(r, e.cfg.WaitingTimeout, "waiting timeout")
	}
	return r, nil
}

func (r *room) role() string {
	if r.sender {
		return "prefill"
	}
	return "decode"
}

// armLocked replaces the room's timer.
func (e *Engine) armLocked(r *room, d time.Duration, why string) {
	if r.timer != nil {
		r.timer.Stop()
	}
	r.gen++
	gen := r.gen
	r.timer = time.AfterFunc(d, func() {
		e.mu.Lock()
		defer e.mu.Unlock()
		if e.rooms[r.id] == r && r.gen == gen {
			e.failLocked(r, why, true)
		}
	})
}

// finishLocked ends r: it leaves the room table (its pages are the engine's
// to free once it sees the final state) and becomes a tombstone.
func (e *Engine) finishLocked(r *room, s State, reason string) {
	if r.st.State.Terminal() {
		return
	}
	if r.timer != nil {
		r.timer.Stop()
	}
	r.gen++
	r.st.State, r.st.Reason = s, reason
	if !r.start.IsZero() {
		r.st.Wall = time.Since(r.start)
	}
	r.queued = nil
	delete(e.rooms, r.id)
	if r.peer != nil {
		delete(r.peer.rooms, r.id)
	}
	e.tombs[r.id] = tomb{st: r.st, end: time.Now()}
	close(r.done)
	e.m.roomsActive.WithLabelValues(r.role()).Dec()
	e.m.roomsDone.WithLabelValues(r.role(), s.String()).Inc()
	if s == Success {
		e.m.duration.WithLabelValues(r.role()).Observe(r.st.Transfer.Seconds())
	}
	if s == Failed {
		e.log.Info("room failed", zap.Uint64("room", r.id), zap.String("role", r.role()), zap.String("reason", reason))
	}
}

// failLocked fails r; with notify, the peer is told with an ABORT.
func (e *Engine) failLocked(r *room, reason string, notify bool) {
	if r.st.State.Terminal() {
		return
	}
	p := r.peer
	e.finishLocked(r, Failed, reason)
	if notify && p != nil {
		p.enqueue(item{msg: &wire.Abort{Room: r.id, Reason: reason}})
	}
}

// Expect (decode) announces that room's KV must land in dst pages (in prompt
// order) and its aux item in auxSlot (-1: none), sent by the prefill engine
// behind bootstrapAddr.
func (e *Engine) Expect(id uint64, bootstrapAddr string, dst []uint32, auxSlot int32) error {
	if e.cfg.Resolve == nil {
		return errors.New("kvtransfer: no bootstrap resolver configured")
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if err := e.checkPages(dst, auxSlot); err != nil {
		return err
	}
	r, err := e.newRoomLocked(id, false, Bootstrapping)
	if err != nil {
		return err
	}
	r.boot, r.dst, r.dstAux = bootstrapAddr, dst, auxSlot
	e.wg.Add(1)
	go e.bootstrap(r)
	return nil
}

// bootstrap finds (or connects) the room's prefill peer and sends XFER_REQ.
func (e *Engine) bootstrap(r *room) {
	defer e.wg.Done()
	ctx, cancel := context.WithTimeout(e.ctx, e.cfg.BootstrapTimeout)
	defer cancel()
	go func() { // stop resolving/dialing as soon as the room ends
		select {
		case <-r.done:
			cancel()
		case <-ctx.Done():
		}
	}()
	p, err := e.peerFor(ctx, r.boot)
	e.mu.Lock()
	defer e.mu.Unlock()
	if r.st.State.Terminal() {
		return
	}
	if err != nil {
		e.failLocked(r, "bootstrap: "+err.Error(), false)
		return
	}
	r.peer = p
	p.rooms[r.id] = r
	r.st.State = WaitingForInput
	r.start = time.Now()
	e.armLocked(r, e.cfg.WaitingTimeout, "waiting timeout")
	p.enqueue(item{msg: &wire.XferReq{Room: r.id, AuxSlot: r.dstAux, DstPages: r.dst}})
}

// Send (prefill) queues one chunk of room's pages; last marks the final
// chunk, whose aux item srcAux (-1: none) goes with it.
func (e *Engine) Send(id uint64, src []uint32, last bool, srcAux int32) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if err := e.checkPages(src, srcAux); err != nil {
		return err
	}
	r := e.rooms[id]
	if r == nil {
		var err error
		if r, err = e.newRoomLocked(id, true, Bootstrapping); err != nil {
			return err
		}
	}
	if !r.sender {
		return fmt.Errorf("room %d is a decode room", id)
	}
	if r.lastSeen {
		return fmt.Errorf("room %d: Send after the last chunk", id)
	}
	r.lastSeen = last
	c := chunk{src: src, last: last, srcAux: srcAux}
	if r.dst == nil {
		r.queued = append(r.queued, c)
		return nil
	}
	e.dispatchLocked(r, c)
	return nil
}

// dispatchLocked maps a chunk onto the decode's pages and queues the batch.
func (e *Engine) dispatchLocked(r *room, c chunk) {
	end := r.assigned + len(c.src)
	switch {
	case end > len(r.dst):
		e.failLocked(r, fmt.Sprintf("prefill sent %d pages, decode expects %d", end, len(r.dst)), true)
		return
	case c.last && end != len(r.dst):
		e.failLocked(r, fmt.Sprintf("last chunk ends at page %d, decode expects %d", end, len(r.dst)), true)
		return
	}
	dst := r.dst[r.assigned:end]
	r.assigned = end
	runs := buildRuns(e.pool, c.src, dst)
	if c.last && c.srcAux >= 0 && r.dstAux >= 0 {
		runs = appendAux(runs, e.pool, c.srcAux, r.dstAux)
	}
	r.st.State = Transferring
	r.peer.enqueue(item{job: &job{r: r, chunk: r.nextChunk, last: c.last, pages: len(c.src), runs: runs}})
	r.nextChunk++
}

// buildRuns merges runs of consecutive indices on both sides, then emits one
// run per KV region per merged run.
func buildRuns(p *Pool, src, dst []uint32) []Run {
	var runs []Run
	for i := 0; i < len(src); {
		j := i + 1
		for j < len(src) && src[j] == src[j-1]+1 && dst[j] == dst[j-1]+1 {
			j++
		}
		for ri, reg := range p.Regions {
			if reg.Kind != wire.KindKV {
				continue
			}
			it := uint64(reg.ItemLen)
			runs = append(runs, Run{Region: ri, SrcOff: uint64(src[i]) * it, DstOff: uint64(dst[i]) * it, Len: uint64(j-i) * it})
		}
		i = j
	}
	return runs
}

func appendAux(runs []Run, p *Pool, src, dst int32) []Run {
	for ri, reg := range p.Regions {
		if reg.Kind == wire.KindAux {
			it := uint64(reg.ItemLen)
			runs = append(runs, Run{Region: ri, SrcOff: uint64(src) * it, DstOff: uint64(dst) * it, Len: it})
		}
	}
	return runs
}

// Poll returns the room's status; a finished room is remembered for Linger.
func (e *Engine) Poll(id uint64) (Status, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if r := e.rooms[id]; r != nil {
		return r.st, nil
	}
	if t, ok := e.tombs[id]; ok {
		return t.st, nil
	}
	return Status{}, ErrUnknownRoom
}

// Wait blocks until the room finishes or ctx ends, then returns its status.
func (e *Engine) Wait(ctx context.Context, id uint64) (Status, error) {
	e.mu.Lock()
	r := e.rooms[id]
	e.mu.Unlock()
	if r != nil {
		select {
		case <-r.done:
		case <-ctx.Done():
			return e.Poll(id)
		}
	}
	return e.Poll(id)
}

// Abort fails the room here and tells its peer.
func (e *Engine) Abort(id uint64, reason string) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	r := e.rooms[id]
	if r == nil {
		if _, ok := e.tombs[id]; ok {
			return nil
		}
		return ErrUnknownRoom
	}
	e.failLocked(r, "aborted: "+reason, true)
	return nil
}

// Close fails every room, closes every peer and waits for all goroutines.
func (e *Engine) Close() error {
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return nil
	}
	e.closed = true
	for _, r := range e.rooms {
		e.failLocked(r, "engine closed", true)
	}
	peers := make([]*peer, 0, len(e.peers))
	for p := range e.peers {
		peers = append(peers, p)
	}
	e.mu.Unlock()
	e.cancel()
	if e.cfg.Listener != nil {
		_ = e.cfg.Listener.Close()
	}
	for _, p := range peers {
		p.close(ErrClosed)
	}
	e.wg.Wait()
	return nil
}

// sweep drops tombstones older than Linger.
func (e *Engine) sweep() {
	defer e.wg.Done()
	t := time.NewTicker(e.cfg.Linger / 2)
	defer t.Stop()
	for {
		select {
		case <-e.ctx.Done():
			return
		case now := <-t.C:
			e.mu.Lock()
			for id, tb := range e.tombs {
				if now.Sub(tb.end) > e.cfg.Linger {
					delete(e.tombs, id)
				}
			}
			e.mu.Unlock()
		}
	}
}
