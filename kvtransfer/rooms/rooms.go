// Package rooms is SGLang's high-level KV-transfer API on top of the
// memory plane (kvtransfer): an engine registers its own memory there,
// describes its KV layout once (Layout), then the decode side calls Expect
// (it finds the prefill's kvproxy through the bootstrap API and sends
// XFER_REQ with its layout and page indices) and the prefill side Send per
// chunk; the prefill kvproxy moves each chunk with the page write an
// engine-memory write makes (MemorySession.WriteOver), over the plane's one
// link to that peer, then sends DONE. Rooms climb SGLang's KVPoll ladder
// (room.go) and every room ends (Success, Failed, abort, bootstrap or
// waiting timeout, a peer silent for two heartbeats: link.go), then
// lingers as a small tombstone.
package rooms

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/pdrouter/pdrouter/kvtransfer"
	"github.com/pdrouter/pdrouter/kvtransfer/wire"
)

// ErrNoLayout: the engine described no room layout (or left with its
// memory).
var ErrNoLayout = errors.New("no room layout registered")

// Layout is an engine's KV as rooms see it: buffers in memory it
// registered (SGLang's kv_data_ptrs, kv_item_lens and aux buffers). Every
// KV buffer holds the same number of pages, every aux buffer the same
// number of slots; page i of a room moves in every KV buffer.
type Layout struct {
	PageSize uint32 // tokens per page; must match the peer's
	Dtype    string // KV dtype tag; must match the peer's
	Bufs     []wire.RoomBuf
}

// maxLayoutBufs bounds a layout (80 layers × K and V plus aux fit).
const maxLayoutBufs = 4096

// items is the number of items of every buffer of kind k.
func (l *Layout) items(k wire.RegionKind) uint32 {
	for _, b := range l.Bufs {
		if b.Kind == k {
			return b.Items
		}
	}
	return 0
}

// Validate checks the invariants rooms rely on.
func (l *Layout) Validate() error {
	if len(l.Bufs) > maxLayoutBufs {
		return fmt.Errorf("room layout: %d buffers, at most %d", len(l.Bufs), maxLayoutBufs)
	}
	if l.items(wire.KindKV) == 0 {
		return errors.New("room layout: no KV buffer")
	}
	for i, b := range l.Bufs {
		switch {
		case b.Kind != wire.KindKV && b.Kind != wire.KindAux:
			return fmt.Errorf("room layout: buffer %d: bad kind %d", i, b.Kind)
		case b.ItemLen == 0 || b.Items == 0:
			return fmt.Errorf("room layout: buffer %d is empty", i)
		case b.Items != l.items(b.Kind):
			return fmt.Errorf("room layout: buffer %d has %d items, others of its kind %d", i, b.Items, l.items(b.Kind))
		case b.Addr+uint64(b.ItemLen)*uint64(b.Items) < b.Addr:
			return fmt.Errorf("room layout: buffer %d wraps", i)
		}
	}
	return nil
}

// compatible checks that a decode's layout (from XFER_REQ) pairs with
// ours buffer by buffer: SGLang checks page size and dtype; mapping page
// indices 1:1 needs the same buffers too.
func (l *Layout) compatible(m *wire.XferReq) error {
	switch {
	case m.PageSize != l.PageSize:
		return fmt.Errorf("decode page size %d, ours %d", m.PageSize, l.PageSize)
	case m.Dtype != l.Dtype:
		return fmt.Errorf("decode dtype %q, ours %q", m.Dtype, l.Dtype)
	case len(m.Bufs) != len(l.Bufs):
		return fmt.Errorf("decode has %d buffers, we have %d", len(m.Bufs), len(l.Bufs))
	}
	peer := Layout{PageSize: m.PageSize, Dtype: m.Dtype, Bufs: m.Bufs}
	if err := peer.Validate(); err != nil {
		return fmt.Errorf("decode's %w", err)
	}
	for i, b := range m.Bufs {
		if o := l.Bufs[i]; b.Kind != o.Kind || b.ItemLen != o.ItemLen {
			return fmt.Errorf("buffer %d: decode kind %d item %d, ours kind %d item %d", i, b.Kind, b.ItemLen, o.Kind, o.ItemLen)
		}
	}
	return checkPages(&peer, m.DstPages, m.AuxSlot)
}

// checkPages refuses page indexes or an aux slot outside l.
func checkPages(l *Layout, pages []uint32, aux int32) error {
	n := l.items(wire.KindKV)
	for _, p := range pages {
		if p >= n {
			return fmt.Errorf("page %d out of range (layout has %d)", p, n)
		}
	}
	if aux >= 0 && uint32(aux) >= l.items(wire.KindAux) {
		return fmt.Errorf("aux slot %d out of range (layout has %d)", aux, l.items(wire.KindAux))
	}
	return nil
}

// Config configures Rooms. Zero durations take the defaults.
type Config struct {
	Memory *kvtransfer.MemoryPlane
	// Resolve maps a bootstrap address (host:port) to the prefill
	// kvproxy's peer address (decode side; nil: Expect is refused).
	Resolve          func(ctx context.Context, bootstrapAddr string) (string, error)
	BootstrapTimeout time.Duration // default 300 s
	WaitingTimeout   time.Duration // default 300 s
	Heartbeat        time.Duration // default 5 s; a link silent for 2 intervals is dead
	Linger           time.Duration // tombstone lifetime, default 60 s
	Logger           *zap.Logger
	Registry         prometheus.Registerer // nil: metrics not exported
}

// Rooms is the room layer of one kvproxy's memory plane. Safe for
// concurrent use.
type Rooms struct {
	cfg    Config
	p      *kvtransfer.MemoryPlane
	log    *zap.Logger
	m      roomMetrics
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu     sync.Mutex
	layout *Layout
	owner  *kvtransfer.MemorySession // whose memory layout lies in; its writes move our chunks
	// Rooms by role (room.go); a room id is in at most one of them.
	prefills map[uint64]*prefillRoom
	decodes  map[uint64]*decodeRoom
	tombs    map[uint64]tomb
	links    map[kvtransfer.Link]*roomLink
	closed   bool
}

// New puts the room layer on cfg.Memory (one per plane).
func New(cfg Config) (*Rooms, error) {
	if cfg.Memory == nil {
		return nil, errors.New("rooms: need a memory plane")
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
	cfg.Logger = cmp.Or(cfg.Logger, zap.NewNop())
	ctx, cancel := context.WithCancel(context.Background())
	r := &Rooms{
		cfg: cfg, p: cfg.Memory, log: cfg.Logger, m: newRoomMetrics(cfg.Registry), ctx: ctx, cancel: cancel,
		prefills: map[uint64]*prefillRoom{}, decodes: map[uint64]*decodeRoom{}, tombs: map[uint64]tomb{},
		links: map[kvtransfer.Link]*roomLink{},
	}
	if err := cfg.Memory.SetRoomHandler(planeHook{r}); err != nil {
		cancel()
		return nil, err
	}
	r.wg.Go(r.sweep)
	return r, nil
}

// SetLayout registers the layout of s's engine: every buffer must lie in
// memory s registered. A layout set by an engine still connected is
// replaced only by that engine.
func (e *Rooms) SetLayout(s *kvtransfer.MemorySession, l Layout) error {
	if err := l.Validate(); err != nil {
		return err
	}
	for i, b := range l.Bufs {
		if !e.p.Owns(s, b.Addr, uint64(b.ItemLen)*uint64(b.Items)) {
			return fmt.Errorf("room layout: buffer %d [%#x,+%d): %w by this engine", i, b.Addr, uint64(b.ItemLen)*uint64(b.Items), kvtransfer.ErrNotRegistered)
		}
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return kvtransfer.ErrClosed
	}
	if e.owner != nil && e.owner != s && !e.owner.Gone() {
		return errors.New("room layout: another connected engine registered one")
	}
	e.layout, e.owner = &l, s
	return nil
}

// Layout is the registered layout (nil before SetLayout).
func (e *Rooms) Layout() *Layout {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.layout
}

// ActiveRooms counts rooms not finished yet.
func (e *Rooms) ActiveRooms() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return len(e.prefills) + len(e.decodes)
}

// Close fails every room and stops the room layer's goroutines; the
// memory plane and its links stay.
func (e *Rooms) Close() error {
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return nil
	}
	e.closed = true
	e.failAllLocked("kvproxy closing")
	e.mu.Unlock()
	e.cancel() // and every link's context, which derives from it
	e.wg.Wait()
	e.p.ClearRoomHandler(planeHook{e})
	return nil
}

// sweep drops tombstones older than Linger.
func (e *Rooms) sweep() {
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

// roomMetrics are the room series, with the names the dashboard reads.
type roomMetrics struct {
	roomsActive *prometheus.GaugeVec
	roomsDone   *prometheus.CounterVec
	bytes       *prometheus.CounterVec
	pages       *prometheus.CounterVec
	duration    *prometheus.HistogramVec
}

func newRoomMetrics(reg prometheus.Registerer) roomMetrics {
	m := roomMetrics{
		roomsActive: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "kvproxy_rooms_active", Help: "Rooms not yet finished.",
		}, []string{"role"}),
		roomsDone: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvproxy_rooms_total", Help: "Finished rooms by final state.",
		}, []string{"role", "state"}),
		bytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvproxy_bytes_total", Help: "KV bytes moved by rooms.",
		}, []string{"direction"}),
		pages: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvproxy_pages_total", Help: "KV pages moved by rooms.",
		}, []string{"direction"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "kvproxy_transfer_duration_seconds",
			Help:    "Time spent moving a room's KV (all chunks' writes).",
			Buckets: prometheus.ExponentialBuckets(20e-6, 2.5, 16),
		}, []string{"role"}),
	}
	if reg != nil {
		reg.MustRegister(m.roomsActive, m.roomsDone, m.bytes, m.pages, m.duration)
	}
	return m
}
