package kvtransfer

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/pdrouter/pdrouter/kvtransfer/wire"
)

// memLink is one connection to a peer kvproxy's memory plane. Either side
// may write through it. One goroutine per link reads: it lands tcp DATA
// frames, answers table requests and fences, and hands answers to the
// writers waiting for them.
type memLink struct {
	p      *MemoryPlane
	conn   *wire.Conn
	remote *wire.MemHello
	// pushesSeen is the plane's table-push count when our MEM_HELLO left.
	pushesSeen uint64

	mu      sync.Mutex
	regions []wire.MemRegion // the peer's table, sorted by Base
	keys    map[uint32]RemoteKey
	ep      MemoryEndpoint
	seq     uint64
	waiting map[uint64]waiter
	// watchdog fails the link when a started write's answer is overdue
	// (watch); watching: it is armed.
	watchdog *time.Timer
	watching bool
	closed   bool
	err      error
	gone     chan struct{} // closed once close has finished

	// keyUse is read-held by a write from its first key lookup until its
	// Put returns, and write-held to forget keys of regions the peer
	// dropped, so no key goes while a write may still use it.
	keyUse sync.RWMutex

	// sendMu keeps a tcp write's DATA frames and its fence together, so a
	// fence answers for exactly the frames of its own write.
	sendMu sync.Mutex
	// dropped is why DATA frames since the last fence were discarded;
	// touched only by the reader, as is stage.
	dropped string
	stage   stageIn
	// ustage is the ucx staged path's state (stageucx.go).
	ustage stageLinkState

	// lastRead is when the reader last got a frame (unix nanos): rooms
	// tell a silent peer by it (rooms/link.go).
	lastRead atomic.Int64
	// directRoutes counts engine sessions told to write small host
	// buffers to this peer themselves (directwrite.go).
	directRoutes atomic.Uint64
}

// hello returns our MEM_HELLO and the count of table pushes its table
// has seen, so addLink can tell whether one went past the new link.
func (p *MemoryPlane) hello() (*wire.MemHello, uint64) {
	p.bmu.Lock()
	defer p.bmu.Unlock()
	return &wire.MemHello{Name: p.cfg.Name, Transport: p.cfg.Transport.Name(), WorkerAddr: p.workerAddr,
		ListenAddr: p.PeerAddr(), Regions: p.table()}, p.pushes
}

// handshake exchanges MEM_HELLOs within the write timeout; the dialer
// speaks first.
func (p *MemoryPlane) handshake(nc net.Conn, dialer bool) (*memLink, error) {
	_ = nc.SetDeadline(time.Now().Add(p.cfg.WriteTimeout))
	conn := wire.NewConn(nc)
	var hello *wire.MemHello
	var pushes uint64
	if dialer {
		hello, pushes = p.hello()
		if err := conn.Write(hello); err != nil {
			return nil, err
		}
	}
	m, err := conn.Read()
	if err != nil {
		return nil, fmt.Errorf("read MEM_HELLO: %w", err)
	}
	h, ok := m.(*wire.MemHello)
	if !ok {
		return nil, fmt.Errorf("%w: %s before MEM_HELLO", wire.ErrMalformed, m.Type())
	}
	if h.Transport != p.cfg.Transport.Name() {
		return nil, fmt.Errorf("peer transport %q, ours %q", h.Transport, p.cfg.Transport.Name())
	}
	if !dialer {
		hello, pushes = p.hello()
		if err := conn.Write(hello); err != nil {
			return nil, err
		}
	}
	_ = nc.SetDeadline(time.Time{})
	conn.SetWriteTimeout(p.cfg.WriteTimeout)
	l := &memLink{p: p, conn: conn, remote: h, pushesSeen: pushes, keys: map[uint32]RemoteKey{}, waiting: map[uint64]waiter{}, gone: make(chan struct{})}
	l.setRegions(h.Regions)
	return l, nil
}

func (p *MemoryPlane) acceptLoop() {
	defer p.wg.Done()
	slots := make(chan struct{}, maxHandshakes) // helloguard.go
	for {
		slots <- struct{}{}
		nc, err := p.cfg.Listener.Accept()
		if err != nil {
			if p.ctx.Err() == nil && !errors.Is(err, net.ErrClosed) {
				p.log.Error("memory plane accept", zap.Error(err))
			}
			return
		}
		p.wg.Add(1)
		go func() {
			defer p.wg.Done()
			stop := context.AfterFunc(p.ctx, func() { _ = nc.Close() })
			_ = nc.SetReadDeadline(time.Now().Add(p.cfg.WriteTimeout))
			c, t, err := admitHello(nc)
			if err == nil && t == wire.TMemClient {
				p.acceptClient(c, slots, stop) // directwrite.go: never a link
				return
			}
			var l *memLink
			if err == nil {
				l, err = p.handshake(c, false)
			}
			<-slots
			stop()
			if err != nil {
				p.log.Warn("memory link handshake", zap.String("remote", nc.RemoteAddr().String()), zap.Error(err))
				_ = nc.Close()
				return
			}
			p.addLink(l, l.remote.ListenAddr, false)
		}()
	}
}

// link returns the link to the peer at addr, dialing it once however many
// writers ask at the same time.
func (p *MemoryPlane) link(ctx context.Context, addr string) (*memLink, error) {
	return p.dialing.get(ctx, &p.mu, addr, func() (*memLink, bool) {
		l := p.byAddr[addr]
		return l, l != nil
	}, func() (*memLink, error) { return p.dial(addr) })
}

// dial is bounded by the write timeout, not by one caller's context: the
// link outlives the call that asked for it.
func (p *MemoryPlane) dial(addr string) (*memLink, error) {
	ctx, cancel := context.WithTimeout(p.ctx, p.cfg.WriteTimeout)
	defer cancel()
	nc, err := (&net.Dialer{}).DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	stop := context.AfterFunc(ctx, func() { _ = nc.Close() })
	l, err := p.handshake(nc, true)
	if !stop() && err == nil {
		err = ctx.Err()
	}
	if err != nil {
		_ = nc.Close()
		return nil, fmt.Errorf("handshake with %s: %w", addr, err)
	}
	if !p.addLink(l, addr, true) {
		return nil, ErrClosed
	}
	return l, nil
}

// addLink starts the link's reader and files it under addr (the dialer's
// entry wins over one an accepted link announced). A table push made
// since our MEM_HELLO missed this link, so the peer gets the table again:
// else it would keep writing into a region we dropped meanwhile.
func (p *MemoryPlane) addLink(l *memLink, addr string, dialed bool) bool {
	p.bmu.Lock()
	defer p.bmu.Unlock()
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		_ = l.conn.Close()
		return false
	}
	p.links[l] = struct{}{}
	if addr != "" && (dialed || p.byAddr[addr] == nil) {
		p.byAddr[addr] = l
	}
	p.m.peers.Inc()
	p.wg.Add(1)
	go l.readLoop()
	p.mu.Unlock()
	if p.pushes != l.pushesSeen {
		if err := l.conn.Write(&wire.MemRegions{Regions: p.table()}); err != nil {
			l.close(fmt.Errorf("push region table: %w", err))
		}
	}
	l.logPaths()
	return true
}

// close tears the link down once: waiting writers fail, the endpoint and
// its keys go. Every caller returns once the link is fully gone.
func (l *memLink) close(cause error) {
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		<-l.gone
		return
	}
	defer close(l.gone)
	l.closed, l.err = true, cause
	var started []waiter // failed once a retry would dial anew
	for _, w := range l.waiting {
		if w.done != nil {
			started = append(started, w)
		} else {
			close(w.ch)
		}
	}
	l.waiting = nil
	if l.watchdog != nil {
		l.watchdog.Stop()
	}
	ep := l.ep
	l.ep, l.keys = nil, nil
	l.mu.Unlock()
	_ = l.conn.Close()
	if ep != nil {
		ep.Close()
	}
	p := l.p
	p.mu.Lock()
	delete(p.links, l)
	for a, x := range p.byAddr {
		if x == l {
			delete(p.byAddr, a)
		}
	}
	p.m.peers.Dec()
	p.mu.Unlock()
	for _, w := range started {
		w.done(nil, fmt.Errorf("link lost: %w", cause))
	}
	p.roomLinkLost(l, cause)
	if !errors.Is(cause, ErrClosed) {
		p.log.Info("memory link closed", zap.String("peer", l.remote.Name), zap.Error(cause))
	}
}

func (l *memLink) readLoop() {
	defer l.p.wg.Done()
	defer l.endStage()
	for {
		m, err := l.conn.Read()
		if err == nil {
			l.lastRead.Store(time.Now().UnixNano())
			err = l.handle(m)
		}
		if err != nil {
			l.close(err)
			return
		}
	}
}

func (l *memLink) handle(m wire.Msg) error {
	if l.stage.inline != nil { // staging.go
		if d, ok := m.(*wire.Data); ok {
			return l.landInline(d)
		}
		return fmt.Errorf("%w: %s after an inline MEM_STAGED", wire.ErrMalformed, m.Type())
	}
	switch m := m.(type) {
	case *wire.Data:
		return l.land(m)
	case *wire.MemRegionsReq:
		// Taken and posted under bmu, as pushes are written: an answer taken
		// before a drop but sent after its push would list the dropped
		// region again. Posted, not written: see wire.Conn.Post.
		l.p.bmu.Lock()
		defer l.p.bmu.Unlock()
		l.conn.Post(&wire.MemRegions{Seq: m.Seq, Regions: l.p.table()})
	case *wire.MemRegions:
		// Installed here, in the link's order, for an answer too: a push
		// read after an answer is the newer table, and a waiter installing
		// the answer itself could put the older one back over it.
		l.setRegions(m.Regions)
		if m.Seq != 0 {
			l.deliver(m.Seq, m)
		}
	case *wire.MemFence:
		// The write completes once its bytes are in GPU memory.
		l.conn.Post(&wire.MemFenceAck{Seq: m.Seq, Err: cmp.Or(l.dropped, l.drain())})
		l.dropped = ""
	case *wire.MemFenceAck:
		l.deliver(m.Seq, m)
	case *wire.MemStageReq:
		l.lendRing(m)
	case *wire.MemStageRing:
		l.deliver(m.Seq, m)
	case *wire.MemStaged:
		return l.landStaged(m)
	case *wire.MemStageFree:
		return l.stageFreed(m.Slot)
	case *wire.XferReq, *wire.Done, *wire.Abort, *wire.Heartbeat:
		return l.p.roomMsg(l, m)
	default:
		return fmt.Errorf("%w: unexpected %s on a memory link", wire.ErrMalformed, m.Type())
	}
	return nil
}

// land reads a DATA frame straight into the region it names; one for a
// region that is gone (or out of its bounds) is discarded and reported at
// the next fence.
func (l *memLink) land(d *wire.Data) error {
	r := l.p.hostRegion(d.Region)
	if r == nil {
		if gr := l.p.gpu.byID(d.Region); gr != nil {
			return l.landGPU(gr, d)
		}
	}
	return l.p.landHost(l.conn, r, d, &l.dropped)
}

// hostRegion is the host region with id (nil: none).
func (p *MemoryPlane) hostRegion(id uint32) *memRegion {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.byID[id]
}

// landHost reads d's bytes from conn into host region r (nil: none has its
// ID). Bytes for a region that is gone or too small are discarded, the
// first such in *dropped for the next fence's answer. The read is bounded
// so a stalled peer cannot hold the region forever.
func (p *MemoryPlane) landHost(conn *wire.Conn, r *memRegion, d *wire.Data, dropped *string) error {
	if r != nil {
		r.use.RLock()
		defer r.use.RUnlock()
		if r.gone {
			r = nil
		}
	}
	if r == nil || d.Offset > uint64(len(r.mem)) || uint64(d.N) > uint64(len(r.mem))-d.Offset {
		if *dropped == "" {
			*dropped = fmt.Sprintf("destination region %d [%d,+%d) is not registered (any more)", d.Region, d.Offset, d.N)
		}
		return conn.DiscardData()
	}
	dst := r.mem[d.Offset : d.Offset+uint64(d.N)]
	if conn.Buffered() >= len(dst) {
		return conn.ReadData(dst) // read in already: no deadline (a timer) to arm
	}
	if err := conn.SetReadTimeout(p.cfg.WriteTimeout); err != nil {
		return err
	}
	if err := conn.ReadData(dst); err != nil {
		return err
	}
	return conn.SetReadTimeout(0)
}

// setRegions installs the peer's table; keys of regions it no longer
// lists are forgotten (beside the reader: a write may hold them), so a
// mapping of a departed engine's memory does not live as long as the link.
func (l *memLink) setRegions(t []wire.MemRegion) {
	t = slices.Clone(t)
	slices.SortFunc(t, func(a, b wire.MemRegion) int { return cmpU64(a.Base, b.Base) })
	l.mu.Lock()
	defer l.mu.Unlock()
	l.regions = t
	var stale []uint32
	for id := range l.keys {
		if !lists(t, id) {
			stale = append(stale, id)
		}
	}
	if len(stale) > 0 && l.ep != nil {
		l.p.wg.Add(1)
		go l.forget(l.ep, stale)
	}
}

// lists reports whether table t holds the region with id.
func lists(t []wire.MemRegion, id uint32) bool {
	return slices.ContainsFunc(t, func(r wire.MemRegion) bool { return r.ID == id })
}

func (l *memLink) forget(ep MemoryEndpoint, ids []uint32) {
	defer l.p.wg.Done()
	l.keyUse.Lock()
	defer l.keyUse.Unlock()
	l.mu.Lock()
	var keys []RemoteKey
	for _, id := range ids {
		if k, ok := l.keys[id]; ok && l.ep == ep {
			keys = append(keys, k)
			delete(l.keys, id)
		}
	}
	l.mu.Unlock()
	for _, k := range keys {
		ep.Forget(k)
	}
}

// waiter takes the answer to one sequence number: await's channel, or a
// callback run where the answer is read (a started write's, failed by
// the watchdog once its deadline passed).
type waiter struct {
	ch       chan wire.Msg
	done     func(wire.Msg, error)
	deadline time.Time
}

// ask registers a waiter for the answer to a new sequence number.
func (l *memLink) ask() (uint64, chan wire.Msg, error) {
	ch := make(chan wire.Msg, 1)
	seq, err := l.expect(waiter{ch: ch})
	return seq, ch, err
}

// expect registers w under a new sequence number, arming the watchdog
// for its deadline unless it is armed already: one timer per link, not
// one per write.
func (l *memLink) expect(w waiter) (uint64, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return 0, l.err
	}
	l.seq++
	l.waiting[l.seq] = w
	if !w.deadline.IsZero() && !l.watching {
		l.watching = true
		if l.watchdog == nil {
			l.watchdog = time.AfterFunc(time.Until(w.deadline), l.watch)
		} else {
			l.watchdog.Reset(time.Until(w.deadline))
		}
	}
	return l.seq, nil
}

// unexpect takes back the waiter of seq, reporting whether it was still
// waiting (else it was answered or failed meanwhile).
func (l *memLink) unexpect(seq uint64) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	_, ok := l.waiting[seq]
	delete(l.waiting, seq)
	return ok
}

// watch closes the link if an answer is overdue (it could no longer be
// matched to anything), else re-arms for the earliest deadline.
func (l *memLink) watch() {
	l.mu.Lock()
	now, next, overdue := time.Now(), time.Time{}, uint64(0)
	for seq, w := range l.waiting {
		switch {
		case w.deadline.IsZero():
		case !now.Before(w.deadline):
			overdue = seq
		case next.IsZero() || w.deadline.Before(next):
			next = w.deadline
		}
	}
	l.watching = overdue == 0 && !next.IsZero() && !l.closed
	if l.watching {
		l.watchdog.Reset(next.Sub(now))
	}
	l.mu.Unlock()
	if overdue != 0 {
		l.close(fmt.Errorf("no answer to %d: %w", overdue, context.DeadlineExceeded))
	}
}

func (l *memLink) deliver(seq uint64, m wire.Msg) {
	l.mu.Lock()
	w, ok := l.waiting[seq]
	delete(l.waiting, seq)
	l.mu.Unlock()
	switch {
	case w.done != nil:
		w.done(m, nil)
	case ok:
		w.ch <- m
	}
}

// await waits for the answer on ch; a link that stays silent past ctx is
// closed, since a later answer could no longer be matched to anything.
func (l *memLink) await(ctx context.Context, seq uint64, ch chan wire.Msg) (wire.Msg, error) {
	select {
	case m, ok := <-ch:
		if !ok {
			l.mu.Lock()
			err := l.err
			l.mu.Unlock()
			return nil, fmt.Errorf("link lost: %w", err)
		}
		return m, nil
	case <-ctx.Done():
		l.close(fmt.Errorf("no answer to %d: %w", seq, ctx.Err()))
		return nil, ctx.Err()
	}
}

// refresh fetches the peer's current table; the reader installs it
// before the answer reaches us.
func (l *memLink) refresh(ctx context.Context) error {
	seq, ch, err := l.ask()
	if err != nil {
		return err
	}
	if err := l.conn.Write(&wire.MemRegionsReq{Seq: seq}); err != nil {
		l.close(err)
		return err
	}
	m, err := l.await(ctx, seq, ch)
	if err != nil {
		return err
	}
	if _, ok := m.(*wire.MemRegions); !ok {
		return fmt.Errorf("%w: %s answered a table request", wire.ErrMalformed, m.Type())
	}
	return nil // the reader installed the table
}

// remoteRegion returns the peer region holding [addr, addr+n).
func (l *memLink) remoteRegion(addr, n uint64) (wire.MemRegion, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	i, _ := slices.BinarySearchFunc(l.regions, addr+1, func(r wire.MemRegion, a uint64) int { return cmpU64(r.Base, a) })
	if i == 0 {
		return wire.MemRegion{}, false
	}
	r := l.regions[i-1]
	if addr+n < addr || addr+n > r.Base+r.Len {
		return wire.MemRegion{}, false
	}
	return r, true
}

// memRun is one merged range of a write.
type memRun struct {
	src          *memRegion
	srcOff       uint64
	dst          wire.MemRegion
	dstOff, size uint64
}

// write resolves and merges the triples, then moves them: one batch and one
// flush (ucx) or DATA frames and one fence (tcp).
func (p *MemoryPlane) write(ctx context.Context, peer string, ts []Triple) error {
	l, err := p.link(ctx, peer)
	if err != nil {
		return err
	}
	return p.writeLink(ctx, l, ts)
}

// writeLink is write over the link l.
func (p *MemoryPlane) writeLink(ctx context.Context, l *memLink, ts []Triple) error {
	if p.gpu.holds(ts) {
		return p.gpu.write(ctx, p, l, ts)
	}
	runs, srcs, err := p.resolve(ctx, l, ts)
	for _, r := range srcs {
		defer r.use.RUnlock()
	}
	if err != nil || len(runs) == 0 {
		return err
	}
	if err := l.hostReachable(runs); err != nil {
		return err
	}
	if err := l.put(ctx, runs); err != nil {
		return err
	}
	var total uint64
	for _, r := range runs {
		total += r.size
	}
	p.m.written.Add(float64(total))
	return nil
}

// hostReachable fails runs into the peer's host memory when no path
// carries them: only shm can lack one (peers on two hosts).
func (l *memLink) hostReachable(runs []memRun) error {
	if !slices.ContainsFunc(runs, func(r memRun) bool { return r.dst.Kind == wire.MemHost }) {
		return nil
	}
	_, err := l.pathTo(HostPlace(l.p.host), Place{Kind: wire.MemHost, Device: -1, Host: l.peerHost()})
	return err
}

// resolve maps the triples onto local and peer regions and merges runs
// contiguous on both sides; a destination the link's table lacks is asked
// for once, unless ctx is nil (Start: then it fails). The source regions
// it returns are read-locked (also on error) and must be unlocked by the
// caller.
func (p *MemoryPlane) resolve(ctx context.Context, l *memLink, ts []Triple) ([]memRun, []*memRegion, error) {
	var runs []memRun
	var srcs []*memRegion
	refreshed := false
	for i, t := range ts {
		if t.Len == 0 {
			continue
		}
		p.mu.Lock()
		src := p.findLocked(t.Src, t.Len)
		p.mu.Unlock()
		if src == nil {
			return nil, srcs, fmt.Errorf("triple %d: source [%#x,+%d): %w here", i, t.Src, t.Len, ErrNotRegistered)
		}
		if !slices.Contains(srcs, src) {
			src.use.RLock()
			srcs = append(srcs, src)
			if src.gone {
				return nil, srcs, fmt.Errorf("triple %d: source [%#x,+%d): %w here", i, t.Src, t.Len, ErrNotRegistered)
			}
		}
		dst, ok := l.remoteRegion(t.Dst, t.Len)
		if !ok && !refreshed && ctx != nil {
			// Registered after our table was fetched: ask once per write.
			refreshed = true
			if err := l.refresh(ctx); err != nil {
				return nil, srcs, fmt.Errorf("refresh peer regions: %w", err)
			}
			dst, ok = l.remoteRegion(t.Dst, t.Len)
		}
		if !ok {
			return nil, srcs, fmt.Errorf("triple %d: destination [%#x,+%d): %w at the peer", i, t.Dst, t.Len, ErrNotRegistered)
		}
		run := memRun{src: src, srcOff: t.Src - src.base, dst: dst, dstOff: t.Dst - dst.Base, size: t.Len}
		if n := len(runs); n > 0 {
			last := &runs[n-1]
			if last.src == src && last.dst.ID == dst.ID && last.srcOff+last.size == run.srcOff && last.dstOff+last.size == run.dstOff {
				last.size += run.size
				continue
			}
		}
		runs = append(runs, run)
	}
	return runs, srcs, nil
}

func (l *memLink) put(ctx context.Context, runs []memRun) error {
	// GPU destinations take the staged path (the peer scatters into device
	// memory): by RMA into the peer's staging ring over ucx, else as DATA
	// frames on the link, as does all host memory where the transport's
	// puts are not zero-copy. Host memory UCX could not register goes by
	// the ring too.
	toGPU := slices.ContainsFunc(runs, func(r memRun) bool { return r.dst.Kind == wire.MemCUDA })
	if l.stagedUCX() && (toGPU || l.hostPath() != PathTCP && slices.ContainsFunc(runs, needsRing)) {
		return l.putStagedHost(ctx, runs)
	}
	if l.hostPath() == PathTCP || toGPU {
		return l.putTCP(ctx, runs)
	}
	return l.putRMA(ctx, runs)
}

// putRMA moves the runs by the transport's puts (as DATA frames where it
// has no endpoint: tcp).
func (l *memLink) putRMA(ctx context.Context, runs []memRun) error {
	ep, err := l.endpoint()
	if err != nil {
		return err
	}
	if ep == nil {
		return l.putTCP(ctx, runs)
	}
	l.keyUse.RLock()
	defer l.keyUse.RUnlock()
	ops := make([]MemoryOp, len(runs))
	for i, r := range runs {
		key, err := l.key(ep, r.dst)
		if err != nil {
			return err
		}
		ops[i] = MemoryOp{Local: r.src.reg, LocalOff: r.srcOff, Key: key, Remote: r.dst.Addr + r.dstOff, Len: r.size}
	}
	if err := ep.Put(ctx, ops); err != nil {
		// The endpoint may be stuck or closed: the next write dials anew.
		l.close(fmt.Errorf("put: %w", err))
		return err
	}
	return nil
}

// endpoint creates the transport endpoint to the peer's worker once (nil
// for tcp).
func (l *memLink) endpoint() (MemoryEndpoint, error) {
	if l.remote.WorkerAddr == nil {
		return nil, nil
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return nil, fmt.Errorf("link lost: %w", l.err)
	}
	if l.ep == nil {
		ep, err := l.p.mt.MemoryEndpoint(l.remote.WorkerAddr)
		if err != nil {
			return nil, fmt.Errorf("connect to peer worker: %w", err)
		}
		l.ep = ep
	}
	return l.ep, nil
}

// key unpacks a peer region's key once per endpoint.
func (l *memLink) key(ep MemoryEndpoint, r wire.MemRegion) (RemoteKey, error) {
	l.mu.Lock()
	k, ok := l.keys[r.ID]
	l.mu.Unlock()
	if ok {
		return k, nil
	}
	if len(r.RKey) == 0 {
		return nil, fmt.Errorf("peer region %d has no remote key", r.ID)
	}
	k, err := ep.Unpack(r.RKey)
	if err != nil {
		return nil, fmt.Errorf("unpack key of peer region %d: %w", r.ID, err)
	}
	l.mu.Lock()
	prev, raced := l.keys[r.ID]
	closed, cause := l.closed, l.err
	// A table dropping r installed during the unpack found no key of it to
	// forget: cached now, it would stay mapped as long as the link.
	listed := lists(l.regions, r.ID)
	if !raced && !closed && listed {
		l.keys[r.ID] = k
	}
	l.mu.Unlock()
	switch {
	case closed: // the endpoint's Close releases k
		return nil, fmt.Errorf("link lost: %w", cause)
	case raced: // a concurrent write unpacked it first
		ep.Forget(k)
		return prev, nil
	case !listed:
		ep.Forget(k)
		return nil, fmt.Errorf("peer region %d: %w at the peer", r.ID, ErrNotRegistered)
	}
	return k, nil
}

// putTCP sends the runs as DATA frames then a fence, and waits for the
// peer to acknowledge that everything before the fence is in memory.
func (l *memLink) putTCP(ctx context.Context, runs []memRun) error {
	pieces := tcpPieces(runs)
	ack, err := l.fencedWith(ctx, func(fence wire.Msg) error { return l.conn.WriteDataThen(pieces, fence) })
	return fenceResult(ack, err)
}

// startTCP is putTCP for Start: the frames and fence go out now, from the
// caller, and the reader hands the answer to done. False (nothing sent,
// done not to run): another write is sending on the link.
func (l *memLink) startTCP(runs []memRun, deadline time.Time, done func(error)) bool {
	if !l.sendMu.TryLock() {
		return false
	}
	defer l.sendMu.Unlock()
	seq, err := l.expect(waiter{deadline: deadline, done: func(m wire.Msg, err error) {
		ack, ok := m.(*wire.MemFenceAck)
		if err == nil && !ok {
			err = fmt.Errorf("%w: %s answered a fence", wire.ErrMalformed, m.Type())
		}
		done(fenceResult(ack, err))
	}})
	if err != nil {
		done(err)
		return true
	}
	return l.conn.TryWriteDataThen(tcpPieces(runs), &wire.MemFence{Seq: seq}) || !l.unexpect(seq)
}

func tcpPieces(runs []memRun) []wire.DataPiece {
	var pieces []wire.DataPiece
	for _, r := range runs {
		pieces = appendPieces(pieces, r.dst.ID, r.dstOff, r.src.mem[r.srcOff:r.srcOff+r.size])
	}
	return pieces
}

// fenceResult is a write's outcome from its fence's answer.
func fenceResult(ack *wire.MemFenceAck, err error) error {
	if err == nil && ack.Err != "" {
		err = fmt.Errorf("peer dropped data: %s", ack.Err)
	}
	return err
}

// fenced runs send (a write's DATA frames) and a fence under sendMu, so the
// fence answers for exactly those frames, and waits for the answer. A
// failed send closes the link; a write abandoned (ctx) closes it too, since
// frames already sent could land after the caller gave up.
func (l *memLink) fenced(ctx context.Context, send func() error) (*wire.MemFenceAck, error) {
	return l.fencedWith(ctx, func(fence wire.Msg) error {
		if err := send(); err != nil {
			return err
		}
		return l.conn.Write(fence)
	})
}

// fencedWith is fenced where send writes the fence too (behind its frames,
// in one system call).
func (l *memLink) fencedWith(ctx context.Context, send func(fence wire.Msg) error) (*wire.MemFenceAck, error) {
	seq, ch, err := l.ask()
	if err != nil {
		return nil, err
	}
	stop := context.AfterFunc(ctx, func() { l.close(fmt.Errorf("write abandoned: %w", ctx.Err())) })
	defer stop()
	l.sendMu.Lock()
	err = send(&wire.MemFence{Seq: seq})
	l.sendMu.Unlock()
	if err != nil {
		l.close(err)
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, err
	}
	m, err := l.await(ctx, seq, ch)
	if err != nil {
		return nil, err
	}
	ack, ok := m.(*wire.MemFenceAck)
	if !ok {
		return nil, fmt.Errorf("%w: %s answered a fence", wire.ErrMalformed, m.Type())
	}
	return ack, nil
}
