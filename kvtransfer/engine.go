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
)

// Errors returned by the engine.
var (
	ErrNoPool = errors.New("no pool registered")
	ErrClosed = errors.New("engine closed")
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

	mu   sync.Mutex
	pool *Pool
	meta LocalMeta
	// Rooms by role (room.go); a room id is in at most one of them.
	prefills map[uint64]*prefillRoom
	decodes  map[uint64]*decodeRoom
	tombs    map[uint64]tomb
	peers    map[*peer]struct{}
	byAddr   map[string]*peer
	dialing  dialOnce[*peer]
	closed   bool
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
		prefills: map[uint64]*prefillRoom{}, decodes: map[uint64]*decodeRoom{}, tombs: map[uint64]tomb{}, peers: map[*peer]struct{}{},
		byAddr: map[string]*peer{}, dialing: dialOnce[*peer]{},
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
	return len(e.prefills) + len(e.decodes)
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

// Close fails every room, closes every peer and waits for all goroutines.
func (e *Engine) Close() error {
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return nil
	}
	e.closed = true
	e.failAllLocked("engine closed")
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
