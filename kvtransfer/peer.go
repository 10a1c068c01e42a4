package kvtransfer

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/pdrouter/pdrouter/kvtransfer/wire"
)

// handshakeTimeout bounds dialing and the HELLO exchange.
const handshakeTimeout = 10 * time.Second

// peer is one connection to another kvproxy: the handshake, the ordered
// send queue, framing and liveness. What the messages mean to rooms is
// room.go's. Three goroutines per peer: reader, writer (messages and jobs,
// in queue order, so DONE follows its data) and heartbeat.
type peer struct {
	e      *Engine
	conn   *wire.Conn
	origin origin
	addr   string // dialed address; "" when accepted
	remote *wire.Hello
	w      Writer // into the peer's pool; accepted peers only

	rooms map[uint64]*room // matched over this peer; guarded by e.mu, kept by room.go

	qmu   sync.Mutex
	queue []item
	wake  chan struct{}

	closeOnce sync.Once
	closed    chan struct{}
	ctx       context.Context // ends when the peer closes
	cancel    context.CancelFunc
}

// origin is which side opened the connection. Rooms' KV flows from the
// accepting side (prefill) to the dialer (decode).
type origin uint8

const (
	dialed origin = iota
	accepted
)

// item is one entry of a peer's send queue: a message, or a job.
type item struct {
	msg wire.Msg
	job job
}

// job runs on the peer's writer goroutine, so what it writes (through the
// transport and on the connection) stays in queue order.
type job interface {
	run(p *peer) error
}

func (p *peer) enqueue(it item) {
	p.qmu.Lock()
	p.queue = append(p.queue, it)
	p.qmu.Unlock()
	select {
	case p.wake <- struct{}{}:
	default:
	}
}

func (e *Engine) localHello() *wire.Hello {
	h := &wire.Hello{
		Name: e.cfg.Name, Transport: e.cfg.Transport.Name(), WorkerAddr: e.meta.WorkerAddr,
		PageSize: e.pool.PageSize, Dtype: e.pool.Dtype,
	}
	for i, r := range e.pool.Regions {
		h.Regions = append(h.Regions, wire.Region{
			Kind: r.Kind, Base: e.meta.Bases[i], Len: uint64(len(r.Mem)), ItemLen: r.ItemLen, RKey: e.meta.RKeys[i],
		})
	}
	return h
}

// compatible checks that a peer's pool has our layout (SGLang checks page
// size and dtype; we also need the same regions to map indices 1:1).
func (e *Engine) compatible(h *wire.Hello) error {
	switch {
	case h.Transport != e.cfg.Transport.Name():
		return fmt.Errorf("peer transport %q, ours %q", h.Transport, e.cfg.Transport.Name())
	case h.PageSize != e.pool.PageSize:
		return fmt.Errorf("peer page size %d, ours %d", h.PageSize, e.pool.PageSize)
	case h.Dtype != e.pool.Dtype:
		return fmt.Errorf("peer dtype %q, ours %q", h.Dtype, e.pool.Dtype)
	case len(h.Regions) != len(e.pool.Regions):
		return fmt.Errorf("peer has %d regions, we have %d", len(h.Regions), len(e.pool.Regions))
	}
	items := map[wire.RegionKind]uint64{}
	for i, r := range h.Regions {
		l := e.pool.Regions[i]
		if r.Kind != l.Kind || r.ItemLen != l.ItemLen {
			return fmt.Errorf("region %d: peer kind %d item %d, ours kind %d item %d", i, r.Kind, r.ItemLen, l.Kind, l.ItemLen)
		}
		n := r.Len / uint64(r.ItemLen)
		if prev, ok := items[r.Kind]; (ok && prev != n) || r.Len%uint64(r.ItemLen) != 0 {
			return fmt.Errorf("region %d: inconsistent length %d", i, r.Len)
		}
		items[r.Kind] = n
	}
	return nil
}

// checkRemote validates page indices against the peer's pool, so a bad
// XFER_REQ can never make us write outside its regions.
func (p *peer) checkRemote(pages []uint32, aux int32) error {
	var kv, auxN uint64
	for _, r := range p.remote.Regions {
		if r.Kind == wire.KindKV {
			kv = r.Len / uint64(r.ItemLen)
		} else {
			auxN = r.Len / uint64(r.ItemLen)
		}
	}
	for _, pg := range pages {
		if uint64(pg) >= kv {
			return fmt.Errorf("destination page %d out of range (peer pool has %d)", pg, kv)
		}
	}
	if aux >= 0 && uint64(aux) >= auxN {
		return fmt.Errorf("destination aux slot %d out of range (peer has %d)", aux, auxN)
	}
	return nil
}

// handshake exchanges HELLOs; the dialer speaks first.
func (e *Engine) handshake(nc net.Conn, dialer bool) (*wire.Conn, *wire.Hello, error) {
	stop := context.AfterFunc(e.ctx, func() { _ = nc.Close() })
	defer stop()
	_ = nc.SetDeadline(time.Now().Add(min(handshakeTimeout, e.cfg.BootstrapTimeout)))
	defer func() { _ = nc.SetDeadline(time.Time{}) }()
	conn := wire.NewConn(nc)
	e.mu.Lock()
	var local *wire.Hello
	if e.pool != nil {
		local = e.localHello()
	}
	e.mu.Unlock()
	if local == nil {
		return nil, nil, ErrNoPool
	}
	if dialer {
		if err := conn.Write(local); err != nil {
			return nil, nil, err
		}
	}
	m, err := conn.Read()
	if err != nil {
		return nil, nil, fmt.Errorf("read HELLO: %w", err)
	}
	h, ok := m.(*wire.Hello)
	if !ok {
		return nil, nil, fmt.Errorf("%w: %s before HELLO", wire.ErrMalformed, m.Type())
	}
	if err := e.compatible(h); err != nil {
		return nil, nil, err
	}
	if !dialer {
		if err := conn.Write(local); err != nil {
			return nil, nil, err
		}
	}
	return conn, h, nil
}

func (e *Engine) acceptLoop() {
	defer e.wg.Done()
	for {
		nc, err := e.cfg.Listener.Accept()
		if err != nil {
			if e.ctx.Err() == nil && !errors.Is(err, net.ErrClosed) {
				e.log.Error("accept", zap.Error(err))
			}
			return
		}
		e.wg.Add(1)
		go func() {
			defer e.wg.Done()
			conn, h, err := e.handshake(nc, false)
			if err != nil {
				e.log.Warn("peer handshake", zap.String("remote", nc.RemoteAddr().String()), zap.Error(err))
				_ = nc.Close()
				return
			}
			w, err := e.cfg.Transport.Connect(h, conn)
			if err != nil {
				e.log.Warn("transport connect", zap.String("peer", h.Name), zap.Error(err))
				_ = nc.Close()
				return
			}
			e.addPeer(&peer{conn: conn, origin: accepted, remote: h, w: w})
		}()
	}
}

// peerFor returns the connected peer behind a bootstrap address.
func (e *Engine) peerFor(ctx context.Context, bootstrapAddr string) (*peer, error) {
	addr, err := e.cfg.Resolve(ctx, bootstrapAddr)
	if err != nil {
		return nil, err
	}
	return e.peerAt(ctx, addr)
}

// peerAt returns the connected peer at a peer address, dialing it once
// however many callers ask at the same time.
func (e *Engine) peerAt(ctx context.Context, addr string) (*peer, error) {
	return e.dialing.get(ctx, &e.mu, addr, func() (*peer, bool) {
		p := e.byAddr[addr]
		return p, p != nil
	}, func() (*peer, error) { return e.dial(addr) })
}

func (e *Engine) dial(addr string) (*peer, error) {
	ctx, cancel := context.WithTimeout(e.ctx, min(handshakeTimeout, e.cfg.BootstrapTimeout))
	defer cancel()
	nc, err := (&net.Dialer{}).DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	conn, h, err := e.handshake(nc, true)
	if err != nil {
		_ = nc.Close()
		return nil, fmt.Errorf("handshake with %s: %w", addr, err)
	}
	p := &peer{conn: conn, origin: dialed, addr: addr, remote: h}
	if !e.addPeer(p) {
		return nil, ErrClosed
	}
	return p, nil
}

// addPeer starts the peer's goroutines unless the engine is closing.
func (e *Engine) addPeer(p *peer) bool {
	p.e = e
	p.rooms = map[uint64]*room{}
	p.wake = make(chan struct{}, 1)
	p.closed = make(chan struct{})
	p.ctx, p.cancel = context.WithCancel(e.ctx)
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		p.cancel()
		_ = p.conn.Close()
		if p.w != nil {
			p.w.Close()
		}
		return false
	}
	e.peers[p] = struct{}{}
	if p.addr != "" {
		e.byAddr[p.addr] = p
	}
	e.m.peers.Inc()
	e.log.Info("peer connected", zap.String("peer", p.remote.Name), zap.String("addr", p.conn.NetConn().RemoteAddr().String()))
	e.wg.Add(3)
	go p.readLoop()
	go p.writeLoop()
	go p.heartbeatLoop()
	return true
}

// close tears the connection down once and fails all its rooms.
func (p *peer) close(cause error) {
	p.closeOnce.Do(func() {
		_ = p.conn.Close()
		close(p.closed)
		p.cancel()
		e := p.e
		e.mu.Lock()
		defer e.mu.Unlock()
		delete(e.peers, p)
		if e.byAddr[p.addr] == p {
			delete(e.byAddr, p.addr)
		}
		e.m.peers.Dec()
		e.peerLostLocked(p, cause)
		if !errors.Is(cause, ErrClosed) {
			e.log.Warn("peer lost", zap.String("peer", p.remote.Name), zap.Error(cause))
		}
	})
}

func (p *peer) readLoop() {
	defer p.e.wg.Done()
	for {
		if err := p.conn.SetReadTimeout(2 * p.e.cfg.Heartbeat); err != nil {
			p.close(err)
			return
		}
		m, err := p.conn.Read()
		if err == nil {
			err = p.handle(m)
		}
		if err != nil {
			p.close(err)
			return
		}
	}
}

func (p *peer) handle(m wire.Msg) error {
	switch m := m.(type) {
	case *wire.Data:
		return p.readData(m)
	case *wire.XferReq:
		p.e.onXferReq(p, m)
	case *wire.Done:
		p.e.onDone(p, m)
	case *wire.Abort:
		p.e.onAbort(p, m)
	case *wire.Heartbeat:
	default:
		return fmt.Errorf("%w: unexpected %s", wire.ErrMalformed, m.Type())
	}
	return nil
}

// readData lands a DATA frame's bytes straight in the destination region.
func (p *peer) readData(d *wire.Data) error {
	pool := p.e.Pool()
	if p.origin != dialed || int(d.Region) >= len(pool.Regions) {
		return fmt.Errorf("%w: DATA for region %d", wire.ErrMalformed, d.Region)
	}
	mem := pool.Regions[d.Region].Mem
	if d.Offset > uint64(len(mem)) || uint64(d.N) > uint64(len(mem))-d.Offset {
		return fmt.Errorf("%w: DATA [%d,+%d) outside region %d", wire.ErrMalformed, d.Offset, d.N, d.Region)
	}
	return p.conn.ReadData(mem[d.Offset : d.Offset+uint64(d.N)])
}

func (p *peer) writeLoop() {
	defer p.e.wg.Done()
	defer func() {
		if p.w != nil {
			p.w.Close()
		}
	}()
	for {
		select {
		case <-p.closed:
			return
		case <-p.wake:
		}
		p.qmu.Lock()
		items := p.queue
		p.queue = nil
		p.qmu.Unlock()
		for _, it := range items {
			var err error
			if it.job != nil {
				err = it.job.run(p)
			} else {
				err = p.conn.Write(it.msg)
			}
			if err != nil {
				p.close(err)
				return
			}
		}
	}
}

func (p *peer) heartbeatLoop() {
	defer p.e.wg.Done()
	t := time.NewTicker(p.e.cfg.Heartbeat)
	defer t.Stop()
	var seq uint64
	for {
		select {
		case <-p.closed:
			return
		case <-t.C:
			seq++
			if err := p.conn.Write(&wire.Heartbeat{Seq: seq}); err != nil {
				p.close(err)
				return
			}
		}
	}
}
