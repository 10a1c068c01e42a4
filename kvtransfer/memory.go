package kvtransfer

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"golang.org/x/sys/unix"

	"github.com/pdrouter/pdrouter/kvtransfer/wire"
)

// Engine-owned memory (Mooncake-style): an engine registers memory it
// allocated itself by passing a memfd of those pages; the kvproxy maps it,
// registers the mapping with its transport once and translates the engine's
// addresses into (region, offset). Writes name source and destination by
// engine addresses; peers exchange their region tables once per link and
// again when a destination is unknown.

// maxMemoryRegion bounds one registration (1 TiB).
const maxMemoryRegion = 1 << 40

// Triple is one range of a memory write: Len bytes from engine address Src
// (this engine's registered memory) to Dst (the peer engine's).
type Triple struct{ Src, Dst, Len uint64 }

// Errors of the engine-memory API.
var (
	ErrCUDAUnsupported = errors.New("cuda memory is not supported in this build")
	ErrNotRegistered   = errors.New("address range not registered")
	ErrClosed          = errors.New("closed")
)

// MemoryConfig configures a MemoryPlane. Zero values take the defaults.
type MemoryConfig struct {
	Name      string
	Transport Transport
	// Listener accepts links from peer kvproxies; its address is the one
	// engines name this kvproxy by (Mooncake's session id).
	Listener net.Listener
	// WriteTimeout bounds a whole Write or Probe (dial, table refresh,
	// transfer, completion), so a dead peer fails it instead of hanging it.
	WriteTimeout time.Duration // default 5 s
	Logger       *zap.Logger
	Registry     prometheus.Registerer // nil: metrics not exported
	// HostID names this machine to peers (default: the boot id); two
	// planes with different ids treat each other as remote (place.go).
	HostID string
	// GPUs opens devices for GPU regions (nil: the CUDA driver).
	GPUs GPUs
	// TransportPuts moves host memory by the transport's puts even where
	// they are not zero-copy (ucx without rc or dc): for tests and
	// measurements of those puts.
	TransportPuts bool
	// StageChunk is how many bytes of GPU memory the staged path gathers
	// and sends per chunk (default 1 MiB, at most 8 MiB). On the H200 over
	// loopback tcp, 1 MiB chunks moved 4.3 GB/s at 4k tokens where 8 MiB
	// moved 3.3 (bench/RESULTS.md).
	StageChunk int
}

// MemoryPlane serves engine-owned memory: the region table, the links to
// peer kvproxies and the writes between them. Safe for concurrent use.
type MemoryPlane struct {
	cfg  MemoryConfig
	mt   Transport // cfg.Transport
	host string    // cfg.HostID or the boot id
	// hostPath is how host memory moves to peers: the transport's own
	// puts, or "tcp" (DATA frames on the link) where its puts are not
	// zero-copy (see UCX.ZeroCopyRMA).
	hostPath   Path
	log        *zap.Logger
	m          memMetrics
	workerAddr []byte
	// remoteWriters: peers store into our mappings behind our back (ucx),
	// so a dropped mapping is replaced by junk memory for a grace period
	// rather than unmapped at once.
	remoteWriters bool
	ctx           context.Context
	cancel        context.CancelFunc
	wg            sync.WaitGroup

	mu         sync.Mutex
	regions    []*memRegion // sorted by base
	byID       map[uint32]*memRegion
	nextID     uint32
	quarantine []quarantined
	links      map[*memLink]struct{}
	byAddr     map[string]*memLink
	dialing    dialOnce[*memLink]
	sessions   int // open sessions; the last one's close drops the links
	closed     bool

	bmu    sync.Mutex // orders region-table pushes
	pushes uint64     // region-table pushes so far; under bmu

	gpu gpuPlane // GPU regions (gpu.go)

	rooms atomic.Pointer[roomHandler] // the room layer on top, if any (peerlink.go)

	direct directStats // engines writing to us themselves (directwrite.go)
}

// memRegion is one registered region.
type memRegion struct {
	id    uint32
	kind  wire.MemKind
	base  uint64
	mem   []byte // the kvproxy's mapping
	fd    int    // the engine's memfd, open while registered
	reg   MemoryRegistration
	owner *MemorySession
	// use is read-held while bytes move out of or into mem and write-held
	// to drop the region, so its mapping never goes away under a transfer.
	use  sync.RWMutex
	gone bool // under use (write)
}

func (r *memRegion) end() uint64 { return r.base + uint64(len(r.mem)) }

// hostPath is how host memory moves to l's peer: the plane's host path,
// unless the transport picks per peer (UCXLocalSHM: shm to a kvproxy of
// the same host).
func (l *memLink) hostPath() Path {
	if pp, ok := l.p.mt.(interface{ PeerPath([]byte) Path }); ok {
		if path := pp.PeerPath(l.remote.WorkerAddr); path != "" {
			return path
		}
	}
	return l.p.hostPath
}

type quarantined struct {
	mem   []byte
	until time.Time
}

// memMetrics are the plane's series, with the names the dashboard reads:
// built with the plane, registered on its registry (none: kept unexported).
type memMetrics struct {
	regions, bytes, peers prometheus.Gauge
	writes                *prometheus.CounterVec
	writesOK, writesErr   prometheus.Counter // writes' two series, looked up once
	written               prometheus.Counter
	// Where a GPU write's time goes: resolving triples into runs (CPU) and
	// the GPU copy including its launch and wait.
	gpuResolve, gpuCopy prometheus.Counter
}

func newMemMetrics(reg prometheus.Registerer) memMetrics {
	m := memMetrics{
		regions: prometheus.NewGauge(prometheus.GaugeOpts{Name: "kvproxy_registered_regions", Help: "Engine memory regions registered now."}),
		bytes:   prometheus.NewGauge(prometheus.GaugeOpts{Name: "kvproxy_registered_bytes", Help: "Bytes of engine memory registered now."}),
		peers:   prometheus.NewGauge(prometheus.GaugeOpts{Name: "kvproxy_peers", Help: "Links to peer kvproxies."}),
		writes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvproxy_memory_writes_total", Help: "Engine-memory writes by result.",
		}, []string{"result"}),
		written: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvproxy_memory_write_bytes_total", Help: "Bytes written into peer engines' memory."}),
		gpuResolve: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvproxy_gpu_write_resolve_seconds_total",
			Help: "Time GPU writes spent turning triples into merged runs."}),
		gpuCopy: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvproxy_gpu_write_copy_seconds_total",
			Help: "Time GPU writes spent in the GPU copy (launch to completion)."}),
	}
	m.writesOK, m.writesErr = m.writes.WithLabelValues("ok"), m.writes.WithLabelValues("error")
	if reg != nil {
		reg.MustRegister(m.regions, m.bytes, m.peers, m.writes, m.written, m.gpuResolve, m.gpuCopy)
	}
	return m
}

// NewMemoryPlane starts accepting peer links on cfg.Listener.
func NewMemoryPlane(cfg MemoryConfig) (*MemoryPlane, error) {
	mt := cfg.Transport
	if mt == nil {
		return nil, errors.New("kvtransfer: memory plane needs a transport")
	}
	if cfg.Listener == nil {
		return nil, errors.New("kvtransfer: memory plane needs a peer listener")
	}
	if cfg.WriteTimeout <= 0 {
		cfg.WriteTimeout = 5 * time.Second
	}
	cfg.Logger = cmp.Or(cfg.Logger, zap.NewNop())
	if cfg.StageChunk <= 0 {
		cfg.StageChunk = defaultStageChunk
	}
	cfg.StageChunk = min(cfg.StageChunk, stageBytes)
	cfg.GPUs = cmp.Or[GPUs](cfg.GPUs, cudaGPUs{})
	host := cfg.HostID
	if host == "" {
		id, err := bootID()
		if err != nil {
			return nil, fmt.Errorf("kvtransfer: host id: %w", err)
		}
		host = string(id)
	}
	hostPath := Path(cfg.Transport.Name())
	if z, ok := mt.(interface{ ZeroCopyRMA() bool }); ok && !cfg.TransportPuts && !z.ZeroCopyRMA() {
		hostPath = PathTCP
	}
	wa, err := mt.WorkerAddress()
	if err != nil {
		return nil, fmt.Errorf("kvtransfer: worker address: %w", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	p := &MemoryPlane{
		cfg: cfg, mt: mt, host: host, hostPath: hostPath, log: cfg.Logger, m: newMemMetrics(cfg.Registry), workerAddr: wa, remoteWriters: wa != nil,
		ctx: ctx, cancel: cancel, byID: map[uint32]*memRegion{}, links: map[*memLink]struct{}{},
		byAddr: map[string]*memLink{}, dialing: dialOnce[*memLink]{},
	}
	if cfg.Registry != nil {
		if err := cfg.Registry.Register(newLinkPathCollector(p)); err != nil {
			cancel()
			return nil, fmt.Errorf("kvtransfer: register kvproxy_link_path: %w", err)
		}
	}
	p.wg.Add(1)
	go p.acceptLoop()
	return p, nil
}

// PeerAddr is where peers reach this kvproxy ("host:port"): what its
// engine reports as its rpc address.
func (p *MemoryPlane) PeerAddr() string { return p.cfg.Listener.Addr().String() }

// TransportName is the transport's name.
func (p *MemoryPlane) TransportName() string { return p.cfg.Transport.Name() }

// Regions counts registered regions.
func (p *MemoryPlane) Regions() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.regions)
}

// Mappings counts the engine-memory mappings this process holds: the
// registered regions and dropped ones still in their grace period (which
// outlives Close: see quarantineGrace).
func (p *MemoryPlane) Mappings() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.regions) + len(p.quarantine)
}

// Links counts open links to peer kvproxies.
func (p *MemoryPlane) Links() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.links)
}

// Close fails writes in flight, closes every link and drops every region;
// call before closing the transport.
func (p *MemoryPlane) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.closed = true
	links := slices.Collect(maps.Keys(p.links))
	p.mu.Unlock()
	p.cancel()
	err := p.cfg.Listener.Close()
	for _, l := range links {
		l.close(ErrClosed)
	}
	p.wg.Wait()
	p.mu.Lock()
	regions := slices.Clone(p.regions)
	p.mu.Unlock()
	for _, r := range regions {
		err = errors.Join(err, p.drop(r, false))
	}
	// Quarantined mappings stay until their grace ends: the transport
	// still runs and a peer's put may still arrive. A process exiting
	// after Close frees them.
	return errors.Join(err, p.sweepQuarantine(time.Now()), p.gpu.close(p))
}

// MemorySession is one engine connection's view: what it registers is
// dropped when it closes, and its writes fail then.
type MemorySession struct {
	p      *MemoryPlane
	ctx    context.Context
	cancel context.CancelFunc
	once   sync.Once
}

// NewSession opens a session.
func (p *MemoryPlane) NewSession() *MemorySession {
	ctx, cancel := context.WithCancel(p.ctx)
	p.mu.Lock()
	p.sessions++
	p.mu.Unlock()
	return &MemorySession{p: p, ctx: ctx, cancel: cancel}
}

// Close fails the session's writes in flight and unregisters everything it
// registered (waiting for transfers that use those regions to end). The
// last session's close also drops the links to peers: with no engine left
// this kvproxy has nothing to write and nothing to be written into.
func (s *MemorySession) Close() error {
	var err error
	s.once.Do(func() { err = s.close() })
	return err
}

func (s *MemorySession) close() error {
	s.cancel()
	p := s.p
	p.mu.Lock()
	// drop edits p.regions: s's regions are collected first.
	mine := slices.DeleteFunc(slices.Clone(p.regions), func(r *memRegion) bool { return r.owner != s })
	p.mu.Unlock()
	_, err := p.gpu.drop(p, true, func(r *gpuRegion) bool { return r.owner == s })
	for _, r := range mine {
		err = errors.Join(err, p.drop(r, true))
	}
	p.mu.Lock()
	p.sessions--
	var links []*memLink
	if p.sessions == 0 {
		links = slices.Collect(maps.Keys(p.links))
	}
	p.mu.Unlock()
	for _, l := range links {
		l.close(errNoEngine)
	}
	return err
}

var errNoEngine = errors.New("no engine connected any more")

// Register maps the memfd fd, which holds the engine's memory [addr,
// addr+length) from file offset 0, and registers the mapping. It takes fd
// (-1: none): kept while registered (the shm transport's peers open it),
// else closed on return. A range identical to one this session
// registered replaces it (the engine remapped it onto a new memfd); any
// other overlap is an error.
func (s *MemorySession) Register(kind wire.MemKind, addr, length uint64, fd int) error {
	keep := false
	if fd >= 0 {
		defer func() {
			if !keep {
				unix.Close(fd)
			}
		}()
	}
	switch {
	case kind == wire.MemCUDA:
		return ErrCUDAUnsupported
	case kind != wire.MemHost:
		return fmt.Errorf("register memory: unknown kind %d", kind)
	case fd < 0:
		return errors.New("register memory: no memfd came with the request")
	case length == 0 || addr+length < addr:
		return fmt.Errorf("register memory: bad range [%#x,+%d)", addr, length)
	case addr%uint64(os.Getpagesize()) != 0:
		return fmt.Errorf("register memory: address %#x is not page-aligned", addr)
	case length > maxMemoryRegion:
		return fmt.Errorf("register memory: %d bytes is too large", length)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return fmt.Errorf("register memory: fstat memfd: %w", err)
	}
	if uint64(st.Size) < length {
		return fmt.Errorf("register memory: memfd holds %d bytes, region is %d", st.Size, length)
	}
	// Populated: the engine's pages exist already, and faulting them in one
	// by one on first use halved the first pass over a pool.
	ptr, err := unix.MmapPtr(fd, 0, nil, uintptr(length), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE)
	if err != nil {
		return fmt.Errorf("register memory: mmap %d bytes: %w", length, err)
	}
	mem := unsafe.Slice((*byte)(ptr), length)
	p := s.p
	p.mu.Lock()
	var replaced *memRegion
	for _, r := range p.regions {
		if r.base < addr+length && addr < r.end() {
			if r.base != addr || r.end() != addr+length || r.owner != s || replaced != nil {
				p.mu.Unlock()
				return errors.Join(fmt.Errorf("register memory: [%#x,+%d) overlaps registered [%#x,+%d)", addr, length, r.base, len(r.mem)), unmap(mem))
			}
			replaced = r
		}
	}
	if p.closed {
		p.mu.Unlock()
		return errors.Join(ErrClosed, unmap(mem))
	}
	reg, err := p.registerHost(mem, fd) // stageucx.go
	if err != nil {
		p.mu.Unlock()
		return errors.Join(fmt.Errorf("register memory with %s: %w", p.cfg.Transport.Name(), err), unmap(mem))
	}
	p.nextID++
	r := &memRegion{id: p.nextID, kind: kind, base: addr, mem: mem, fd: fd, reg: reg, owner: s}
	keep = true
	if replaced != nil {
		p.removeLocked(replaced)
	}
	i, _ := slices.BinarySearchFunc(p.regions, addr, func(r *memRegion, a uint64) int { return cmpU64(r.base, a) })
	p.regions = slices.Insert(p.regions, i, r)
	p.byID[r.id] = r
	p.m.regions.Inc()
	p.m.bytes.Add(float64(length))
	p.mu.Unlock()
	if replaced != nil {
		return p.release(replaced, true)
	}
	return nil
}

// Unregister drops the region holding engine address addr.
func (s *MemorySession) Unregister(addr uint64) error {
	p := s.p
	p.mu.Lock()
	r := p.findLocked(addr, 1)
	p.mu.Unlock()
	if r == nil || r.owner != s {
		if ok, err := p.gpu.drop(p, true, func(gr *gpuRegion) bool { return gr.owner == s && gr.base <= addr && addr < gr.end() }); ok {
			return err
		}
		return fmt.Errorf("unregister memory: %#x: %w", addr, ErrNotRegistered)
	}
	return p.drop(r, true)
}

// Write copies every triple into the peer engine behind peer (its kvproxy's
// PeerAddr) and returns once the bytes are complete there.
func (s *MemorySession) Write(ctx context.Context, peer string, ts []Triple) error {
	return s.write(ctx, peer, writeDeadline(s.p.cfg.WriteTimeout, ts), func(ctx context.Context) error { return s.p.write(ctx, peer, ts) })
}

// write runs move within the deadline, cut short if the engine goes away,
// and counts its outcome.
func (s *MemorySession) write(ctx context.Context, peer string, deadline time.Duration, move func(context.Context) error) error {
	ctx, cancel := context.WithTimeout(ctx, deadline)
	defer cancel()
	defer context.AfterFunc(s.ctx, cancel)()
	return s.outcome(peer, move(ctx))
}

// outcome counts a write's result and names the peer in its error.
func (s *MemorySession) outcome(peer string, err error) error {
	if err != nil {
		s.p.m.writesErr.Inc()
		if s.ctx.Err() != nil {
			return fmt.Errorf("write to %s: engine disconnected: %w", peer, err)
		}
		return fmt.Errorf("write to %s: %w", peer, err)
	}
	s.p.m.writesOK.Inc()
	return nil
}

// minWriteRate is the slowest rate a write may move at before it times
// out: a write gets the write timeout plus its bytes' time at this rate, so
// a 1 GiB chunk is not cut off on a slow link while a dead peer (which
// transports mostly report at once: reset, endpoint error, a frame that
// cannot be sent within the write timeout) still fails in bounded time.
const minWriteRate = 64 << 20 // bytes per second

func writeDeadline(base time.Duration, ts []Triple) time.Duration {
	var total uint64
	for _, t := range ts {
		total += min(t.Len, 1<<50) // bogus lengths fail resolve; keep the sum sane
	}
	return base + time.Duration(float64(total)/minWriteRate*float64(time.Second))
}

// Probe connects to peer (if not yet) and fetches its region table.
func (s *MemorySession) Probe(ctx context.Context, peer string) error {
	ctx, cancel := context.WithTimeout(ctx, s.p.cfg.WriteTimeout)
	defer cancel()
	defer context.AfterFunc(s.ctx, cancel)()
	l, err := s.p.link(ctx, peer)
	if err == nil {
		err = l.refresh(ctx)
	}
	if err != nil {
		return fmt.Errorf("probe %s: %w", peer, err)
	}
	return nil
}

func cmpU64(a, b uint64) int { return cmp.Compare(a, b) }

// findLocked returns the region holding [addr, addr+n), or nil.
func (p *MemoryPlane) findLocked(addr, n uint64) *memRegion {
	i, _ := slices.BinarySearchFunc(p.regions, addr+1, func(r *memRegion, a uint64) int { return cmpU64(r.base, a) })
	if i == 0 {
		return nil
	}
	r := p.regions[i-1]
	if addr+n < addr || addr+n > r.end() {
		return nil
	}
	return r
}

func (p *MemoryPlane) removeLocked(r *memRegion) {
	if p.byID[r.id] != r {
		return
	}
	delete(p.byID, r.id)
	p.regions = slices.DeleteFunc(p.regions, func(x *memRegion) bool { return x == r })
	p.m.regions.Dec()
	p.m.bytes.Sub(float64(len(r.mem)))
}

// drop removes r from the table and releases it.
func (p *MemoryPlane) drop(r *memRegion, push bool) error {
	p.mu.Lock()
	if p.byID[r.id] != r {
		p.mu.Unlock()
		return nil // dropped meanwhile
	}
	p.removeLocked(r)
	p.mu.Unlock()
	return p.release(r, push)
}

// release waits for transfers using r, unregisters it and unmaps it (or
// puts it in quarantine), then tells peers the table changed.
func (p *MemoryPlane) release(r *memRegion, push bool) error {
	r.use.Lock()
	r.gone = true
	err := errors.Join(r.reg.Close(), unix.Close(r.fd))
	if p.remoteWriters {
		err = errors.Join(err, p.quarantineMapping(r.mem))
	} else {
		err = errors.Join(err, unmap(r.mem))
	}
	r.mem = nil
	r.use.Unlock()
	if push {
		p.pushTable()
	}
	return err
}

// quarantineGrace is how long a dropped mapping stays as junk memory: a
// peer's put already posted against it (or sent before our table push
// reached it) lands there instead of in unmapped or reused memory.
const quarantineGrace = 30 * time.Second

// quarantineMapping replaces mem in place with private anonymous memory,
// freeing the engine's pages now and the address range after the grace.
func (p *MemoryPlane) quarantineMapping(mem []byte) error {
	_, err := unix.MmapPtr(-1, 0, unsafe.Pointer(unsafe.SliceData(mem)), uintptr(len(mem)),
		unix.PROT_READ|unix.PROT_WRITE, unix.MAP_FIXED|unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_NORESERVE)
	if err != nil {
		return errors.Join(fmt.Errorf("quarantine mapping: %w", err), unmap(mem))
	}
	now := time.Now()
	err = p.sweepQuarantine(now)
	p.mu.Lock()
	p.quarantine = append(p.quarantine, quarantined{mem: mem, until: now.Add(quarantineGrace)})
	p.mu.Unlock()
	return err
}

// sweepQuarantine unmaps quarantined mappings whose grace ended by now.
func (p *MemoryPlane) sweepQuarantine(now time.Time) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	var err error
	p.quarantine = slices.DeleteFunc(p.quarantine, func(q quarantined) bool {
		if now.Before(q.until) {
			return false
		}
		err = errors.Join(err, unmap(q.mem))
		return true
	})
	return err
}

func unmap(mem []byte) error {
	if len(mem) == 0 {
		return nil
	}
	return unix.MunmapPtr(unsafe.Pointer(unsafe.SliceData(mem)), uintptr(len(mem)))
}

// table is the region table as peers see it.
func (p *MemoryPlane) table() []wire.MemRegion {
	p.mu.Lock()
	defer p.mu.Unlock()
	t := make([]wire.MemRegion, len(p.regions))
	for i, r := range p.regions {
		t[i] = wire.MemRegion{ID: r.id, Kind: r.kind, Base: r.base, Len: uint64(len(r.mem)),
			Addr: uint64(uintptr(unsafe.Pointer(unsafe.SliceData(r.mem)))), RKey: r.reg.RKey()}
	}
	return append(t, p.gpu.table()...)
}

// pushTable sends the current table to every linked peer, so none keeps
// writing into a region that went away.
func (p *MemoryPlane) pushTable() {
	p.bmu.Lock()
	defer p.bmu.Unlock()
	p.pushes++
	t := p.table()
	p.mu.Lock()
	links := slices.Collect(maps.Keys(p.links))
	p.mu.Unlock()
	for _, l := range links {
		if err := l.conn.Write(&wire.MemRegions{Regions: t}); err != nil {
			l.close(fmt.Errorf("push region table: %w", err))
		}
	}
}
