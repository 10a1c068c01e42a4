package kvtransfer

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"unsafe"

	"go.uber.org/zap"

	"github.com/pdrouter/pdrouter/kvtransfer/wire"
)

// Staged-ucx: the receiver lends each link a staging ring of pinned host
// memory registered with the transport (MEM_STAGE_REQ, answered by
// MEM_STAGE_RING); its slots are the writer's credits. Per chunk the writer
// puts into a free slot by RMA, from a registered staging buffer or
// straight from registered host memory, then names the slot's pieces in
// MEM_STAGED; the receiver scatters the slot in link order and hands it
// back (MEM_STAGE_FREE).

// stageSlots is how many slots a writer asks for: two windows of puts, so
// that one window is on the wire while the receiver scatters and hands
// back the other.
const stageSlots = 2 * stageWindow

// stageWindow is how many puts a writer keeps in flight. Over UCX's tcp
// lanes an endpoint flush completes only once the lane's queue drains, so
// every put in flight completes together with the last one posted: with
// as many puts in flight as slots, each round of the ring stopped the
// wire for a MEM_STAGED, a scatter and a MEM_STAGE_FREE round trip (all
// slots' puts completed at once, TestStagedUCXNextWindowWhileScattering).
const stageWindow = 4

// maxStageSlots bounds what a receiver grants.
const maxStageSlots = 8

// stageLinkState is a link's ucx staging: the peer's ring it writes into
// and the ring it lends the peer.
type stageLinkState struct {
	mu   sync.Mutex // serializes asking for the peer's ring
	out  atomic.Pointer[peerRing]
	none atomic.Bool // the peer has no ring to lend: DATA frames instead
	in   *ownRing
}

// peerRing is the receiver's ring as the writer uses it.
type peerRing struct {
	addr    uint64
	slotLen int
	key     RemoteKey
	free    chan uint32 // slots the receiver has scattered: credits
}

// ownRing is the ring this side lends its link's peer; touched only by the
// link's reader.
type ownRing struct {
	pool    *stagePool
	buf     []byte
	reg     MemoryRegistration
	slotLen int
	slots   int
}

// stagedUCX reports whether writes with device memory on an end go by RMA
// into the peer's staging ring rather than as DATA frames: over ucx where
// its puts are zero-copy (rc, dc), as for host memory. Over UCX's tcp its
// puts are emulated and slower than DATA frames on the same socket (93
// against 428 MB/s, bench/RESULTS.md), so the staged path stays staged-tcp
// there unless MemoryConfig.TransportPuts or PDROUTER_STAGE_PUTS=1 (for
// measurements) asks for puts.
func (l *memLink) stagedUCX() bool {
	return l.p.cfg.Transport.Name() == "ucx" && l.remote.WorkerAddr != nil && (l.p.hostPath == PathUCX || stagePuts)
}

var stagePuts = os.Getenv("PDROUTER_STAGE_PUTS") == "1"

// ring returns the endpoint and the peer's ring a staged write puts into,
// asking for the ring once: none (DATA frames) unless stagedUCX and the
// peer lends one.
func (l *memLink) ring(ctx context.Context, chunk int) (MemoryEndpoint, *peerRing, error) {
	if !l.stagedUCX() {
		return nil, nil, nil
	}
	ep, err := l.endpoint()
	if err != nil {
		return nil, nil, err
	}
	st := &l.ustage
	st.mu.Lock()
	defer st.mu.Unlock()
	if r := st.out.Load(); r != nil || st.none.Load() {
		return ep, r, nil
	}
	seq, ch, err := l.ask()
	if err != nil {
		return nil, nil, err
	}
	if err := l.conn.Write(&wire.MemStageReq{Seq: seq, SlotLen: uint32(chunk), Slots: stageSlots}); err != nil {
		l.close(err)
		return nil, nil, err
	}
	m, err := l.await(ctx, seq, ch)
	if err != nil {
		return nil, nil, err
	}
	a, ok := m.(*wire.MemStageRing)
	switch {
	case !ok:
		return nil, nil, fmt.Errorf("%w: %s answered a staging request", wire.ErrMalformed, m.Type())
	case a.Err != "":
		st.none.Store(true)
		l.p.log.Warn("peer lends no staging ring: GPU bytes to it go as DATA frames (staged-tcp)",
			zap.String("peer", l.remote.Name), zap.String("why", a.Err))
		return ep, nil, nil
	case a.Slots == 0 || a.Slots > maxStageSlots || a.SlotLen == 0 || a.SlotLen > wire.MaxDataLen || a.Addr == 0:
		return nil, nil, fmt.Errorf("%w: staging ring of %d slots of %d bytes", wire.ErrMalformed, a.Slots, a.SlotLen)
	}
	key, err := ep.Unpack(a.RKey)
	if err != nil {
		return nil, nil, fmt.Errorf("unpack the peer's staging key: %w", err)
	}
	r := &peerRing{addr: a.Addr, slotLen: int(a.SlotLen), key: key, free: make(chan uint32, a.Slots)}
	for i := range a.Slots {
		r.free <- i
	}
	st.out.Store(r)
	return ep, r, nil
}

// flights are a write's puts in flight, one per slot, as many as the
// peer lends slots: each slot's MEM_STAGED goes out once its put is
// complete, in the order the puts were posted (the receiver scatters in
// that order, so a later triple still wins).
type flights struct {
	l      *memLink
	ctx    context.Context
	ep     MemoryEndpoint
	r      *peerRing
	queue  chan flight
	window chan struct{} // a token per put in flight
	done   chan struct{}
	failed atomic.Bool
	err    error // the first failure; the runner's until done is closed
}

type flight struct {
	slot    uint32
	pieces  []wire.StagedPiece
	res     chan error
	release func() error
}

var errFlightFailed = errors.New("an earlier put of the write failed")

func (l *memLink) startFlights(ctx context.Context, ep MemoryEndpoint, r *peerRing) *flights {
	fs := &flights{l: l, ctx: ctx, ep: ep, r: r, queue: make(chan flight, cap(r.free)),
		window: make(chan struct{}, stageWindow), done: make(chan struct{})}
	go fs.run()
	return fs
}

func (fs *flights) run() {
	defer close(fs.done)
	for f := range fs.queue {
		err := <-f.res
		if f.release != nil {
			err = errors.Join(err, f.release())
		}
		if err == nil && fs.err == nil {
			err = fs.l.conn.Write(&wire.MemStaged{Slot: f.slot, Pieces: f.pieces})
		}
		if err != nil && fs.err == nil {
			fs.err = err
			fs.failed.Store(true)
		}
	}
}

// post waits for a free slot and room in the window, and starts filling
// it by ops from offset 0 on (an op's Remote is its offset in the slot
// until post adds the slot's address); pieces say where its bytes go, and
// release (if any) runs once the put is over.
func (fs *flights) post(ops []MemoryOp, pieces []wire.StagedPiece, release func() error) error {
	fail := func(err error) error {
		if release != nil {
			err = errors.Join(err, release())
		}
		return err
	}
	if fs.failed.Load() {
		return fail(errFlightFailed)
	}
	var slot uint32
	select {
	case slot = <-fs.r.free:
	case <-fs.ctx.Done():
		return fail(fs.ctx.Err())
	case <-fs.l.gone:
		return fail(fs.l.lost())
	}
	select {
	case fs.window <- struct{}{}:
	case <-fs.ctx.Done():
		fs.r.free <- slot // never filled: still the writer's
		return fail(fs.ctx.Err())
	case <-fs.l.gone:
		fs.r.free <- slot
		return fail(fs.l.lost())
	}
	base := fs.r.addr + uint64(slot)*uint64(fs.r.slotLen)
	for i := range ops {
		ops[i].Key, ops[i].Remote = fs.r.key, base+ops[i].Remote
	}
	res := make(chan error, 1)
	go func() {
		err := fs.ep.Put(fs.ctx, ops)
		<-fs.window
		if err != nil {
			err = fmt.Errorf("put into the peer's staging slot: %w", err)
		}
		res <- err
	}()
	fs.queue <- flight{slot: slot, pieces: pieces, res: res, release: release}
	return nil
}

// wait returns once every put is over and its MEM_STAGED sent.
func (fs *flights) wait() error {
	close(fs.queue)
	<-fs.done
	return fs.err
}

func (l *memLink) lost() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	return fmt.Errorf("link lost: %w", l.err)
}

// putChunk puts a gathered chunk from its registered buffer, which goes
// back to pool once the put is complete.
func (l *memLink) putChunk(fs *flights, pool *stagePool, c stagedChunk) error {
	reg, err := pool.registration(l.p.mt, c.buf)
	if err != nil {
		return errors.Join(err, pool.put(c.buf))
	}
	return fs.post([]MemoryOp{{Local: reg, Len: uint64(len(c.buf))}}, c.pieces, func() error { return pool.put(c.buf) })
}

// putStagedHost moves host-memory runs over the peer's staging ring: into
// its GPU regions, or into host regions a side could not register with
// UCX. A slot is filled by RMA straight from the runs' registered memory;
// a slot with a source UCX refused is first copied into a registered
// staging buffer of host memory.
func (l *memLink) putStagedHost(ctx context.Context, runs []memRun) error {
	ep, r, err := l.ring(ctx, l.p.cfg.StageChunk)
	if err != nil || r == nil {
		if err == nil {
			err = l.putTCP(ctx, runs)
		}
		return err
	}
	ack, err := l.fenced(ctx, func() error {
		fs := l.startFlights(ctx, ep, r)
		var ops []MemoryOp
		var pieces []wire.StagedPiece
		var from []memRun // each piece's source: srcOff and size are the piece's
		used := 0
		for _, run := range runs {
			for done := uint64(0); done < run.size; {
				n := min(run.size-done, uint64(r.slotLen-used))
				ops = append(ops, MemoryOp{Local: run.src.reg, LocalOff: run.srcOff + done, Remote: uint64(used), Len: n})
				pieces = append(pieces, wire.StagedPiece{Region: run.dst.ID, Offset: run.dstOff + done, N: uint32(n)})
				from = append(from, memRun{src: run.src, srcOff: run.srcOff + done, size: n})
				used += int(n)
				done += n
				if used == r.slotLen {
					if err := l.postHost(fs, ops, pieces, from); err != nil {
						return errors.Join(err, fs.wait())
					}
					ops, pieces, from, used = nil, nil, nil, 0
				}
			}
		}
		var err error
		if used > 0 {
			err = l.postHost(fs, ops, pieces, from)
		}
		return errors.Join(err, fs.wait())
	})
	return fenceResult(ack, err)
}

// postHost posts a slot of host pieces (from: their sources), through a
// staging buffer if UCX refused one of the sources.
func (l *memLink) postHost(fs *flights, ops []MemoryOp, pieces []wire.StagedPiece, from []memRun) error {
	if !slices.ContainsFunc(from, func(r memRun) bool { return !registered(r.src.reg) }) {
		return fs.post(ops, pieces, nil)
	}
	pool := l.p.gpu.pool(nil)
	buf, err := pool.get()
	if err != nil {
		return err
	}
	off := 0
	for _, r := range from {
		off += copy(buf[off:], r.src.mem[r.srcOff:r.srcOff+r.size])
	}
	return l.putChunk(fs, pool, stagedChunk{buf: buf[:off], pieces: pieces})
}

// needsRing reports whether host run r cannot go by a direct put: UCX
// refused its source or the peer's destination.
func needsRing(r memRun) bool { return !registered(r.src.reg) || len(r.dst.RKey) == 0 }

// unregistered stands in for a registration UCX refused (UCX 1.13's
// shared-memory transports cannot map memory another process mapped): the
// region moves through the staging rings instead of by direct puts.
type unregistered struct{}

func (unregistered) RKey() []byte { return nil }
func (unregistered) Close() error { return nil }

func registered(r MemoryRegistration) bool {
	_, no := r.(unregistered)
	return !no
}

// registerHost registers engine memory with the transport. Memory ucx
// refuses stays registered with the plane, unregistered with UCX: it
// moves by the staged path, and the log says so.
func (p *MemoryPlane) registerHost(mem []byte, fd int) (MemoryRegistration, error) {
	reg, err := p.mt.RegisterMemory(mem, fd)
	if err == nil || p.cfg.Transport.Name() != "ucx" {
		return reg, err
	}
	p.log.Warn("ucx cannot register engine memory: it moves through staging buffers (staged-ucx)",
		zap.Int("bytes", len(mem)), zap.Error(err))
	return unregistered{}, nil
}

// stageFreed takes a slot the peer handed back.
func (l *memLink) stageFreed(slot uint32) error {
	r := l.ustage.out.Load()
	if r == nil || int(slot) >= cap(r.free) {
		return fmt.Errorf("%w: MEM_STAGE_FREE of slot %d not lent", wire.ErrMalformed, slot)
	}
	select {
	case r.free <- slot:
		return nil
	default:
		return fmt.Errorf("%w: slot %d freed twice", wire.ErrMalformed, slot)
	}
}

// lendRing answers a writer's MEM_STAGE_REQ with this link's ring, made
// and registered on first request: pinned memory of the device engines'
// allocations are opened on (host memory on a plane without GPUs).
func (l *memLink) lendRing(m *wire.MemStageReq) {
	st := &l.ustage
	if st.in == nil {
		in, err := l.newRing(int(min(m.SlotLen, wire.MaxDataLen)), int(min(m.Slots, maxStageSlots)))
		if err != nil {
			l.conn.Post(&wire.MemStageRing{Seq: m.Seq, Err: err.Error()})
			return
		}
		st.in = in
	}
	in := st.in
	l.conn.Post(&wire.MemStageRing{Seq: m.Seq, Addr: uint64(uintptr(unsafe.Pointer(unsafe.SliceData(in.buf)))),
		SlotLen: uint32(in.slotLen), Slots: uint32(in.slots), RKey: in.reg.RKey()})
}

func (l *memLink) newRing(slotLen, slots int) (*ownRing, error) {
	if slotLen <= 0 || slots <= 0 {
		return nil, fmt.Errorf("a ring of %d slots of %d bytes", slots, slotLen)
	}
	pool := l.p.gpu.devPool()
	buf, err := pool.getRing(slotLen * slots)
	if err != nil {
		return nil, err
	}
	reg, err := l.p.mt.RegisterMemory(buf, -1)
	if err != nil {
		return nil, errors.Join(fmt.Errorf("register the staging ring: %w", err), pool.putRing(buf))
	}
	return &ownRing{pool: pool, buf: buf, reg: reg, slotLen: slotLen, slots: slots}, nil
}

// releaseRing deregisters the ring lent on this link (its scatterer has
// stopped); the memory goes back to its pool, not to the driver, so a put
// of the dead link still in flight lands in memory nobody reads.
func (l *memLink) releaseRing() {
	in := l.ustage.in
	if in == nil {
		return
	}
	l.ustage.in = nil
	if err := errors.Join(in.reg.Close(), in.pool.putRing(in.buf)); err != nil {
		l.p.log.Warn("release a staging ring: " + err.Error())
	}
}

// landStaged queues the scatter of a slot the writer filled, which goes
// back to the writer once done (or, inline, notes the chunk to come).
func (l *memLink) landStaged(m *wire.MemStaged) error {
	if m.Slot == wire.InlineSlot {
		l.stage.inline = m // landInline takes it with the next frame
		return nil
	}
	in := l.ustage.in
	if in == nil || int(m.Slot) >= in.slots {
		return fmt.Errorf("%w: MEM_STAGED into slot %d not lent", wire.ErrMalformed, m.Slot)
	}
	slot := in.buf[int(m.Slot)*in.slotLen : (int(m.Slot)+1)*in.slotLen]
	return l.scatter(slot, m.Pieces, func() { l.conn.Post(&wire.MemStageFree{Slot: m.Slot}) })
}
