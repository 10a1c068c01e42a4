package kvtransfer

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/pdrouter/pdrouter/kvtransfer/wire"
)

// The staged path (place.go's PathStagedTCP): GPU memory that the writing
// kvproxy cannot reach by a device copy travels as host bytes. The writer
// gathers the source pages into pinned staging buffers of its own, one
// chunk at a time, and sends each as DATA frames on the peer link while
// the next is gathered. The receiver reads frames bound for a GPU region
// back to back into a staging buffer of its own and scatters it into the
// device when it is full and at the write's fence, so the fence's answer
// (the write's completion) comes only after the last scatter.

// stageBytes is one staging buffer: a whole DATA frame fits, so a
// receiver never splits one.
const stageBytes = wire.MaxDataLen

// defaultStageChunk is what a writer gathers and sends at a time.
const defaultStageChunk = 1 << 20

// stageKeep is how many free buffers a pool keeps; more are made when
// more are in use at once (a pool never blocks: a reader waiting for a
// buffer another link holds could stall both ends) and freed on return.
const stageKeep = 8

// stagePool hands out one device's staging buffers, and the rings
// (stageucx.go) lent to peers; with no device (hostPool), plain host
// memory.
type stagePool struct {
	dev  Device
	mu   sync.Mutex
	idle [][]byte
	out  int // handed out and not returned
	lent int // rings lent to links and not returned
	// regs are the buffers' transport registrations, made on a buffer's
	// first RMA and kept as long as the buffer.
	regs  map[*byte]MemoryRegistration
	rings [][]byte // rings returned, kept for the next link until close
}

func (sp *stagePool) get() ([]byte, error) {
	sp.mu.Lock()
	defer sp.mu.Unlock()
	if n := len(sp.idle); n > 0 {
		b := sp.idle[n-1]
		sp.idle = sp.idle[:n-1]
		sp.out++
		return b, nil
	}
	b, err := sp.alloc(stageBytes)
	if err != nil {
		return nil, fmt.Errorf("allocate a staging buffer: %w", err)
	}
	sp.out++
	return b, nil
}

// alloc and free take a device's pinned memory, or anonymous mappings
// without one: never Go memory, which a put of a link gone could still
// reach after the collector reused it.
func (sp *stagePool) alloc(n int) ([]byte, error) {
	if sp.dev == nil {
		return unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	}
	return sp.dev.AllocStage(n)
}

func (sp *stagePool) free(b []byte) error {
	if sp.dev == nil {
		return unix.Munmap(b)
	}
	return sp.dev.FreeStage(b)
}

func (sp *stagePool) name() string {
	if sp.dev == nil {
		return "host memory"
	}
	return fmt.Sprintf("GPU %d", sp.dev.Ordinal())
}

func (sp *stagePool) put(b []byte) error {
	b = b[:cap(b)]
	sp.mu.Lock()
	defer sp.mu.Unlock()
	sp.out--
	if len(sp.idle) < stageKeep {
		sp.idle = append(sp.idle, b)
		return nil
	}
	return errors.Join(sp.unregisterLocked(b), sp.free(b))
}

// registration is b's registration with mt, made once per buffer.
func (sp *stagePool) registration(mt MemoryTransport, b []byte) (MemoryRegistration, error) {
	b = b[:cap(b)]
	sp.mu.Lock()
	defer sp.mu.Unlock()
	if r := sp.regs[unsafe.SliceData(b)]; r != nil {
		return r, nil
	}
	r, err := mt.RegisterMemory(b, -1)
	if err != nil {
		return nil, fmt.Errorf("register a staging buffer: %w", err)
	}
	if sp.regs == nil {
		sp.regs = map[*byte]MemoryRegistration{}
	}
	sp.regs[unsafe.SliceData(b)] = r
	return r, nil
}

func (sp *stagePool) unregisterLocked(b []byte) error {
	r := sp.regs[unsafe.SliceData(b)]
	if r == nil {
		return nil
	}
	delete(sp.regs, unsafe.SliceData(b))
	return r.Close()
}

// getRing returns n bytes for a ring: a returned ring of that size, or a
// new one.
func (sp *stagePool) getRing(n int) ([]byte, error) {
	sp.mu.Lock()
	defer sp.mu.Unlock()
	for i, b := range sp.rings {
		if len(b) == n {
			sp.rings = slices.Delete(sp.rings, i, i+1)
			sp.lent++
			return b, nil
		}
	}
	b, err := sp.alloc(n)
	if err != nil {
		return nil, fmt.Errorf("allocate a staging ring: %w", err)
	}
	sp.lent++
	return b, nil
}

func (sp *stagePool) putRing(b []byte) error {
	sp.mu.Lock()
	defer sp.mu.Unlock()
	sp.lent--
	sp.rings = append(sp.rings, b)
	return nil
}

// outstanding counts buffers and rings handed out and not yet returned.
func (sp *stagePool) outstanding() (bufs, rings int) {
	sp.mu.Lock()
	defer sp.mu.Unlock()
	return sp.out, sp.lent
}

// close frees the pool's buffers; every one must have come back.
func (sp *stagePool) close() error {
	sp.mu.Lock()
	defer sp.mu.Unlock()
	var err error
	if sp.out != 0 || sp.lent != 0 {
		err = fmt.Errorf("%d staging buffers and %d rings of %s never came back", sp.out, sp.lent, sp.name())
	}
	for _, b := range sp.idle {
		err = errors.Join(err, sp.unregisterLocked(b), sp.free(b))
	}
	for _, b := range sp.rings {
		err = errors.Join(err, sp.free(b))
	}
	sp.idle, sp.rings = nil, nil
	return err
}

// pool returns dev's staging pool, made on first use.
func (g *gpuPlane) pool(dev Device) *stagePool {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.pools == nil {
		g.pools = map[int]*stagePool{}
	}
	sp := g.pools[dev.Ordinal()]
	if sp == nil {
		sp = &stagePool{dev: dev}
		g.pools[dev.Ordinal()] = sp
	}
	return sp
}

// hostPool is the staging pool of plain host memory (key -1), for planes
// and memory without a device.
func (g *gpuPlane) hostPool() *stagePool {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.pools == nil {
		g.pools = map[int]*stagePool{}
	}
	sp := g.pools[-1]
	if sp == nil {
		sp = &stagePool{}
		g.pools[-1] = sp
	}
	return sp
}

// stagedOut is the number of staging buffers (and rings) handed out on
// every device.
func (g *gpuPlane) stagedOut() (bufs, rings int) {
	g.mu.Lock()
	pools := make([]*stagePool, 0, len(g.pools))
	for _, sp := range g.pools {
		pools = append(pools, sp)
	}
	g.mu.Unlock()
	for _, sp := range pools {
		b, r := sp.outstanding()
		bufs, rings = bufs+b, rings+r
	}
	return bufs, rings
}

func (g *gpuPlane) closePools() error {
	g.mu.Lock()
	defer g.mu.Unlock()
	var err error
	for o, sp := range g.pools {
		err = errors.Join(err, sp.close())
		delete(g.pools, o)
	}
	return err
}

// stagedRun is one merged range of a staged write: n bytes from device
// address src into the peer's region dst at dstOff.
type stagedRun struct {
	src    uint64
	dst    uint32
	dstOff uint64
	n      uint64
}

// resolveStaged maps ts (sources on dev) onto stagedRuns, merging runs
// contiguous on both sides. Source regions are read-locked and added to
// srcs, as resolve does.
func (g *gpuPlane) resolveStaged(ctx context.Context, l *memLink, dev Device, ts []Triple, srcs []*gpuRegion) ([]stagedRun, []*gpuRegion, uint64, error) {
	var runs []stagedRun
	var total uint64
	refreshed := false
	var src *gpuRegion
	var dst wire.MemRegion
	for i, t := range ts {
		if t.Len == 0 {
			continue
		}
		var err error
		if src, srcs, err = g.sourceOf(t, src, dev, srcs); err != nil {
			return nil, srcs, 0, fmt.Errorf("triple %d: %w", i, err)
		}
		if dst.Len == 0 || t.Dst < dst.Base || t.Dst+t.Len > dst.Base+dst.Len {
			if dst, err = l.lookup(ctx, t.Dst, t.Len, &refreshed); err != nil {
				return nil, srcs, 0, fmt.Errorf("triple %d: %w", i, err)
			}
		}
		r := stagedRun{src: src.ptr + (t.Src - src.base), dst: dst.ID, dstOff: t.Dst - dst.Base, n: t.Len}
		total += t.Len
		if k := len(runs); k > 0 {
			last := &runs[k-1]
			if last.dst == r.dst && last.src+last.n == r.src && last.dstOff+last.n == r.dstOff {
				last.n += r.n
				continue
			}
		}
		runs = append(runs, r)
	}
	return runs, srcs, total, nil
}

// writeStaged moves ts (GPU sources on dev) by the staged path.
func (g *gpuPlane) writeStaged(ctx context.Context, p *MemoryPlane, l *memLink, dev Device, ts []Triple) error {
	var srcs []*gpuRegion
	defer func() {
		for _, r := range srcs {
			r.use.RUnlock()
		}
	}()
	runs, srcs, total, err := g.resolveStaged(ctx, l, dev, ts, srcs)
	if err != nil || len(runs) == 0 {
		return err
	}
	pool := g.pool(dev)
	switch {
	case g.localDest(l, runs[0].dst):
		err = g.copyStagedLocal(ctx, l, pool, p.cfg.StageChunk, runs)
	case l.stagedUCX():
		err = l.sendStagedUCX(ctx, pool, p.cfg.StageChunk, runs)
	default:
		err = l.sendStaged(ctx, pool, p.cfg.StageChunk, runs)
	}
	if err != nil {
		return err
	}
	p.m.written.Add(float64(total))
	return nil
}

// stagedChunk is what one gather fills and one send empties.
type stagedChunk struct {
	buf    []byte
	pieces []wire.DataPiece
}

// sendStaged gathers runs chunk by chunk (at most chunk bytes each) into
// pool's buffers while the previous chunk goes out as DATA frames, then
// fences and waits for the peer to confirm every byte is in place. Every
// buffer is back in the pool when it returns.
func (l *memLink) sendStaged(ctx context.Context, pool *stagePool, chunk int, runs []stagedRun) error {
	var gerr error
	ack, err := l.fenced(ctx, func() error {
		// A gather that failed part way: the frames sent so far still get
		// their fence, so the link stays in step.
		var serr error
		serr, gerr = pipeline(ctx, pool, chunk, runs, func(c stagedChunk) error {
			return errors.Join(l.sendInline(c), pool.put(c.buf))
		})
		return serr
	})
	return stagedResult(ack, err, gerr)
}

// sendInline sends a gathered chunk as one frame: MEM_STAGED names its
// pieces, one DATA frame carries them back to back (a DATA frame per piece
// cost the receiver two reads each: every other 32 KiB page ran at half
// the rate of contiguous pages, BenchmarkStagedPages).
func (l *memLink) sendInline(c stagedChunk) error {
	pieces := make([]wire.StagedPiece, len(c.pieces))
	n := 0
	for i, p := range c.pieces {
		pieces[i] = wire.StagedPiece{Region: p.Region, Offset: p.Offset, N: uint32(len(p.Data))}
		n += len(p.Data)
	}
	if err := l.conn.Write(&wire.MemStaged{Slot: wire.InlineSlot, Pieces: pieces}); err != nil {
		return err
	}
	return l.conn.WriteData(0, 0, c.buf[:n])
}

// pipeline gathers runs into pool's buffers, chunk bytes at most each, on
// one goroutine while this one hands the previous chunk to emit, which
// returns its buffer to the pool (at once or once done with it). The first
// error of emit stops the gathering. It returns emit's error and the
// gather's.
func pipeline(ctx context.Context, pool *stagePool, chunk int, runs []stagedRun, emit func(stagedChunk) error) (serr, gerr error) {
	gctx, cancel := context.WithCancel(ctx)
	defer cancel()
	filled := make(chan stagedChunk, 1)
	go func() {
		defer close(filled)
		gerr = gatherChunks(gctx, pool, chunk, runs, filled)
	}()
	for c := range filled {
		if serr != nil {
			serr = errors.Join(serr, pool.put(c.buf))
		} else if serr = emit(c); serr != nil {
			cancel() // the gatherer stops; the rest is drained
		}
	}
	return serr, gerr
}

// gatherChunks fills buffers from pool with runs, chunk bytes at most
// each, and hands them to out in order. A buffer it cannot hand over goes
// back to the pool.
func gatherChunks(ctx context.Context, pool *stagePool, chunk int, runs []stagedRun, out chan<- stagedChunk) error {
	var c stagedChunk
	var spans []Span
	used := 0
	flush := func() error {
		err := pool.dev.Gather(c.buf[:used], spans)
		if err == nil {
			select {
			case out <- c:
				c, spans, used = stagedChunk{}, spans[:0], 0
				return nil
			case <-ctx.Done():
				err = ctx.Err()
			}
		}
		err = errors.Join(err, pool.put(c.buf))
		c.buf = nil
		return err
	}
	for _, r := range runs {
		for done := uint64(0); done < r.n; {
			if ctx.Err() != nil {
				return errors.Join(ctx.Err(), putIf(pool, c.buf))
			}
			if c.buf == nil {
				b, err := pool.get()
				if err != nil {
					return err
				}
				c.buf = b[:chunk]
			}
			n := min(r.n-done, uint64(chunk-used))
			spans = append(spans, Span{Addr: r.src + done, Len: n})
			c.pieces = append(c.pieces, wire.DataPiece{Region: r.dst, Offset: r.dstOff + done, Data: c.buf[used : used+int(n)]})
			used += int(n)
			done += n
			if used == chunk {
				if err := flush(); err != nil {
					return err
				}
			}
		}
	}
	if used > 0 {
		return flush()
	}
	return putIf(pool, c.buf)
}

func putIf(pool *stagePool, b []byte) error {
	if b == nil {
		return nil
	}
	return pool.put(b[:cap(b)])
}

// stageIn is a link reader's staging of DATA frames bound for GPU
// regions: the reader fills one batch while a scatterer goroutine (the
// reader's, started on first use and ended when it ends) moves the
// previous one into device memory.
type stageIn struct {
	cur  *stagedBatch
	work chan *stagedBatch
	done chan struct{}
	err  string // the first scatter failure since the last fence; the scatterer's until a barrier returns
	// inline is an inline MEM_STAGED whose DATA frame comes next.
	inline *wire.MemStaged
}

// stagedBatch is bytes to scatter: a staging buffer's frames (pool set:
// the buffer goes back to it), or a stretch of a ring slot (from: its
// offset in the slot) bound for one device or (dev nil) host regions. Or
// it is a marker: barrier, closed once everything before it is done;
// freed, run once everything before it is done.
type stagedBatch struct {
	pool     *stagePool
	dev      Device
	buf      []byte
	from     int
	used     int
	spans    []Span
	host     [][]byte     // host destinations, back to back in buf
	held     []*gpuRegion // read-locked until their bytes are scattered
	heldHost []*memRegion
	barrier  chan struct{}
	freed    func()
}

// landGPU reads a DATA frame for GPU region r into the current batch.
func (l *memLink) landGPU(r *gpuRegion, d *wire.Data) error {
	st := &l.stage
	pool := l.p.gpu.pool(r.dev)
	if b := st.cur; b != nil && (b.pool != pool || len(b.buf)-b.used < int(d.N)) {
		l.submit()
	}
	// A region the batch holds is read-locked already: locking it again on
	// this goroutine could deadlock behind a waiting unregister.
	held := st.cur != nil && slices.Contains(st.cur.held, r)
	if !held {
		r.use.RLock()
	}
	if !held && r.gone || d.Offset > r.n || uint64(d.N) > r.n-d.Offset {
		if !held {
			r.use.RUnlock()
		}
		if l.dropped == "" {
			l.dropped = fmt.Sprintf("destination region %d [%d,+%d) is not registered (any more)", d.Region, d.Offset, d.N)
		}
		return l.conn.DiscardData()
	}
	if st.cur == nil {
		buf, err := pool.get()
		if err != nil {
			r.use.RUnlock()
			return err
		}
		st.cur = &stagedBatch{pool: pool, dev: pool.dev, buf: buf}
	}
	b := st.cur
	if !held {
		b.held = append(b.held, r)
	}
	if err := l.conn.SetReadTimeout(l.p.cfg.WriteTimeout); err != nil {
		return err
	}
	if err := l.conn.ReadData(b.buf[b.used : b.used+int(d.N)]); err != nil {
		return err
	}
	b.spans = append(b.spans, Span{Addr: r.ptr + d.Offset, Len: uint64(d.N)})
	b.used += int(d.N)
	if b.used == len(b.buf) {
		l.submit()
	}
	return l.conn.SetReadTimeout(0)
}

// landInline reads the chunk an inline MEM_STAGED announced (d, its DATA
// frame) into a staging buffer in one read and queues its scatter.
func (l *memLink) landInline(d *wire.Data) error {
	m := l.stage.inline
	l.stage.inline = nil
	var total uint64
	for _, pc := range m.Pieces {
		total += uint64(pc.N)
	}
	if d.Region != 0 || uint64(d.N) != total {
		return fmt.Errorf("%w: DATA of region %d, %d bytes, after an inline MEM_STAGED of %d", wire.ErrMalformed, d.Region, d.N, total)
	}
	buf, release, err := l.inlineBuf(m.Pieces)
	if err != nil {
		return err
	}
	err = l.conn.SetReadTimeout(l.p.cfg.WriteTimeout)
	if err == nil {
		err = l.conn.ReadData(buf[:total])
	}
	if err == nil {
		err = l.conn.SetReadTimeout(0)
	}
	if err != nil {
		release()
		return err
	}
	return l.scatterPieces(buf[:total], m.Pieces, release)
}

// inlineBuf is a buffer for an inline chunk: from the staging pool of the
// device its first GPU piece goes to (or of the plane's first device), of
// host memory where the plane has no GPU.
func (l *memLink) inlineBuf(pieces []wire.StagedPiece) ([]byte, func(), error) {
	g := &l.p.gpu
	var dev Device
	for _, pc := range pieces {
		if r := g.byID(pc.Region); r != nil {
			dev = r.dev
			break
		}
	}
	if dev == nil {
		g.mu.Lock()
		dev = g.dev
		g.mu.Unlock()
	}
	pool := g.hostPool()
	if dev != nil {
		pool = g.pool(dev)
	}
	buf, err := pool.get()
	if err != nil {
		return nil, nil, err
	}
	return buf, func() {
		if err := pool.put(buf); err != nil {
			l.p.log.Warn("free a staging buffer: " + err.Error())
		}
	}, nil
}

// submit hands the current batch to the scatterer.
func (l *memLink) submit() {
	st := &l.stage
	if st.cur == nil {
		return
	}
	l.submitBatch(st.cur)
	st.cur = nil
}

// submitBatch queues b for the scatterer, starting it on first use.
func (l *memLink) submitBatch(b *stagedBatch) {
	st := &l.stage
	if st.work == nil {
		st.work, st.done = make(chan *stagedBatch, 1), make(chan struct{})
		go l.scatterer(st.work, st.done)
	}
	st.work <- b
}

// drain submits the current batch and waits until every batch is in
// device memory; it returns the first scatter failure since the last
// drain.
func (l *memLink) drain() string {
	st := &l.stage
	l.submit()
	if st.work == nil {
		return ""
	}
	b := &stagedBatch{barrier: make(chan struct{})}
	st.work <- b
	<-b.barrier
	err := st.err
	st.err = ""
	return err
}

// endStage scatters what is left, stops the scatterer and releases the
// ring lent to the peer (the reader is ending).
func (l *memLink) endStage() {
	st := &l.stage
	l.submit()
	if st.work != nil {
		close(st.work)
		<-st.done
	}
	l.releaseRing()
}

// scatterer moves batches into device memory in order, then returns each
// buffer and unlocks its regions.
func (l *memLink) scatterer(work <-chan *stagedBatch, done chan<- struct{}) {
	defer close(done)
	for b := range work {
		switch {
		case b.barrier != nil:
			close(b.barrier)
			continue
		case b.freed != nil:
			b.freed()
			continue
		case b.dev != nil:
			if err := b.dev.Scatter(b.spans, b.buf[:b.used]); err != nil && l.stage.err == "" {
				l.stage.err = "scatter into GPU memory: " + err.Error()
			}
		default:
			off := 0
			for _, d := range b.host {
				off += copy(d, b.buf[off:])
			}
		}
		if b.pool != nil {
			if err := b.pool.put(b.buf); err != nil {
				l.p.log.Warn("free a staging buffer: " + err.Error())
			}
		}
		for _, r := range b.held {
			r.use.RUnlock()
		}
		for _, r := range b.heldHost {
			r.use.RUnlock()
		}
	}
}
