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

// The staged paths (place.go): GPU memory the writing kvproxy cannot reach
// by a device copy moves through pinned host staging buffers, by one
// pipeline: the writer gathers the source pages chunk by chunk while the
// previous chunk is scattered here (staged-local, stagelocal.go), put into
// the peer's staging ring (staged-ucx, stageucx.go) or sent inline
// (staged-tcp). A receiver queues what it reads for its link's scatterer
// and answers the write's fence only after the last scatter.

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
// (stageucx.go) lent to peers; with no device, plain host memory.
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
	var b []byte
	var err error
	if n := len(sp.idle); n > 0 {
		b, sp.idle = sp.idle[n-1], sp.idle[:n-1]
	} else if b, err = sp.alloc(stageBytes); err != nil {
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

// put returns b (nil: none) to the pool.
func (sp *stagePool) put(b []byte) error {
	if b == nil {
		return nil
	}
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
func (sp *stagePool) registration(mt Transport, b []byte) (MemoryRegistration, error) {
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
	var b []byte
	var err error
	if i := slices.IndexFunc(sp.rings, func(b []byte) bool { return len(b) == n }); i >= 0 {
		b = sp.rings[i] // before Delete, which clears the slot it vacates
		sp.rings = slices.Delete(sp.rings, i, i+1)
	} else if b, err = sp.alloc(n); err != nil {
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

// pool returns dev's staging pool (nil dev: plain host memory), made on
// first use.
func (g *gpuPlane) pool(dev Device) *stagePool {
	key := -1
	if dev != nil {
		key = dev.Ordinal()
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.pools == nil {
		g.pools = map[int]*stagePool{}
	}
	sp := g.pools[key]
	if sp == nil {
		sp = &stagePool{dev: dev, regs: map[*byte]MemoryRegistration{}}
		g.pools[key] = sp
	}
	return sp
}

// devPool is the pool of the device engines' allocations are opened on
// (host memory on a plane without GPUs).
func (g *gpuPlane) devPool() *stagePool {
	g.mu.Lock()
	dev := g.dev
	g.mu.Unlock()
	return g.pool(dev)
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

// writeStaged moves ts (GPU sources on dev) by a staged path: scattered
// here into a device of this host (stagelocal.go), or sent to the peer.
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
	if g.localDest(l, runs[0].dst) {
		err = g.copyStagedLocal(ctx, l, g.pool(dev), p.cfg.StageChunk, runs)
	} else {
		err = l.sendStaged(ctx, g.pool(dev), p.cfg.StageChunk, runs)
	}
	if err != nil {
		return err
	}
	p.m.written.Add(float64(total))
	return nil
}

// stagedChunk is what one gather fills and one send empties: buf holds
// the pieces back to back.
type stagedChunk struct {
	buf    []byte
	pieces []wire.StagedPiece
}

// sendStaged sends the gathered chunks to the peer: by RMA into a slot of
// its staging ring where the link has one (staged-ucx, stageucx.go), else
// inline (staged-tcp). Then it fences; the answer comes after the peer's
// last scatter. Every buffer is back in the pool when it returns.
func (l *memLink) sendStaged(ctx context.Context, pool *stagePool, chunk int, runs []stagedRun) error {
	ep, ring, err := l.ring(ctx, chunk)
	if err != nil {
		return err
	}
	var gerr error
	ack, err := l.fenced(ctx, func() error {
		// A gather that failed part way: the chunks sent so far still get
		// their fence, so the link stays in step.
		emit := func(c stagedChunk) error { return errors.Join(l.sendInline(c), pool.put(c.buf)) }
		var fs *flights
		if ring != nil {
			fs, chunk = l.startFlights(ctx, ep, ring), min(chunk, ring.slotLen)
			emit = func(c stagedChunk) error { return l.putChunk(fs, pool, c) }
		}
		serr, g := pipeline(ctx, pool, chunk, runs, emit)
		gerr = g
		if fs != nil {
			serr = errors.Join(serr, fs.wait())
		}
		return serr
	})
	if err == nil && gerr != nil {
		return fmt.Errorf("gather: %w", gerr)
	}
	return fenceResult(ack, err)
}

// sendInline sends a gathered chunk as one frame: MEM_STAGED names its
// pieces, one DATA frame carries them back to back (a DATA frame per piece
// cost the receiver two reads each: every other 32 KiB page ran at half
// the rate of contiguous pages, BenchmarkStagedPages).
func (l *memLink) sendInline(c stagedChunk) error {
	if err := l.conn.Write(&wire.MemStaged{Slot: wire.InlineSlot, Pieces: c.pieces}); err != nil {
		return err
	}
	return l.conn.WriteData(0, 0, c.buf)
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
	flush := func() error {
		err := pool.dev.Gather(c.buf, spans)
		if err == nil {
			select {
			case out <- c:
				c, spans = stagedChunk{}, spans[:0]
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
				return errors.Join(ctx.Err(), pool.put(c.buf))
			}
			if c.buf == nil {
				b, err := pool.get()
				if err != nil {
					return err
				}
				c.buf = b[:0]
			}
			n := min(r.n-done, uint64(chunk-len(c.buf)))
			spans = append(spans, Span{Addr: r.src + done, Len: n})
			c.pieces = append(c.pieces, wire.StagedPiece{Region: r.dst, Offset: r.dstOff + done, N: uint32(n)})
			c.buf = c.buf[:len(c.buf)+int(n)]
			done += n
			if len(c.buf) == chunk {
				if err := flush(); err != nil {
					return err
				}
			}
		}
	}
	if len(c.buf) > 0 {
		return flush()
	}
	return pool.put(c.buf)
}

// stageIn is a link reader's side of the staged paths: it queues what it
// read (an inline chunk, a ring slot, DATA frames bound for GPU regions)
// for its scatterer goroutine (started on first use, ended with the
// reader), which moves each into the regions in link order.
type stageIn struct {
	work   chan scatterJob
	done   chan struct{}
	err    string      // the first drop or scatter failure since the last fence; the scatterer's until a barrier returns
	frames *scatterJob // DATA frames for GPU regions read back to back into a staging buffer
	pool   *stagePool  // where frames.buf came from
	// inline is an inline MEM_STAGED whose DATA frame comes next.
	inline *wire.MemStaged
}

// scatterJob is bytes to scatter (buf holds pieces back to back; release
// runs once they are in place), or a barrier, closed once every job
// before it is done.
type scatterJob struct {
	buf     []byte
	pieces  []wire.StagedPiece
	release func()
	barrier chan struct{}
}

// landGPU reads a DATA frame for GPU region r after the frames before it
// in a staging buffer of r's device, scattered when it is full.
func (l *memLink) landGPU(r *gpuRegion, d *wire.Data) error {
	st := &l.stage
	pool := l.p.gpu.pool(r.dev)
	if f := st.frames; f != nil && (st.pool != pool || cap(f.buf)-len(f.buf) < int(d.N)) {
		l.submit()
	}
	if st.frames == nil {
		buf, err := pool.get()
		if err != nil {
			return err
		}
		st.frames, st.pool = &scatterJob{buf: buf[:0], release: l.returner(pool, buf)}, pool
	}
	f := st.frames
	if err := l.readBounded(f.buf[len(f.buf) : len(f.buf)+int(d.N)]); err != nil {
		return err
	}
	f.buf = f.buf[:len(f.buf)+int(d.N)]
	f.pieces = append(f.pieces, wire.StagedPiece{Region: d.Region, Offset: d.Offset, N: d.N})
	if len(f.buf) == cap(f.buf) {
		l.submit()
	}
	return nil
}

// readBounded reads a DATA frame's bytes within the write timeout, so a
// stalled peer cannot hold a staging buffer forever.
func (l *memLink) readBounded(b []byte) error {
	if err := l.conn.SetReadTimeout(l.p.cfg.WriteTimeout); err != nil {
		return err
	}
	if err := l.conn.ReadData(b); err != nil {
		return err
	}
	return l.conn.SetReadTimeout(0)
}

// returner returns buf to pool, for a scatterJob's release.
func (l *memLink) returner(pool *stagePool, buf []byte) func() {
	return func() {
		if err := pool.put(buf); err != nil {
			l.p.log.Warn("free a staging buffer: " + err.Error())
		}
	}
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
	// The staging pool of the device the first GPU piece goes to.
	pool := l.p.gpu.devPool()
	for _, pc := range m.Pieces {
		if r := l.p.gpu.byID(pc.Region); r != nil {
			pool = l.p.gpu.pool(r.dev)
			break
		}
	}
	buf, err := pool.get()
	if err != nil {
		return err
	}
	release := l.returner(pool, buf)
	if err := l.readBounded(buf[:total]); err != nil {
		release()
		return err
	}
	return l.scatter(buf[:total], m.Pieces, release)
}

// scatter queues buf's pieces for the scatterer, after the DATA frames
// read before them; release runs once they are in place.
func (l *memLink) scatter(buf []byte, pieces []wire.StagedPiece, release func()) error {
	var total uint64
	for _, pc := range pieces {
		total += uint64(pc.N)
	}
	if total > uint64(len(buf)) {
		release()
		return fmt.Errorf("%w: staged pieces of more than %d bytes", wire.ErrMalformed, len(buf))
	}
	l.submit()
	l.queue(scatterJob{buf: buf, pieces: pieces, release: release})
	return nil
}

// submit queues the DATA frames read so far.
func (l *memLink) submit() {
	if f := l.stage.frames; f != nil {
		l.stage.frames = nil
		l.queue(*f)
	}
}

// queue hands j to the scatterer, starting it on first use.
func (l *memLink) queue(j scatterJob) {
	st := &l.stage
	if st.work == nil {
		st.work, st.done = make(chan scatterJob, 1), make(chan struct{})
		go l.scatterer(st.work, st.done)
	}
	st.work <- j
}

// drain waits until everything read is in place; it returns the first
// drop or scatter failure since the last drain.
func (l *memLink) drain() string {
	st := &l.stage
	l.submit()
	if st.work == nil {
		return ""
	}
	barrier := make(chan struct{})
	st.work <- scatterJob{barrier: barrier}
	<-barrier
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

func (l *memLink) scatterer(work <-chan scatterJob, done chan<- struct{}) {
	defer close(done)
	for j := range work {
		if j.barrier != nil {
			close(j.barrier)
			continue
		}
		if err := l.landPieces(j.buf, j.pieces); err != "" && l.stage.err == "" {
			l.stage.err = err
		}
		j.release()
	}
}

// landPieces moves buf's pieces into their regions: a copy per host piece,
// one Scatter per stretch of pieces bound for one device, with the
// stretch's regions read-locked until it is done. A piece whose region is
// gone, or that lies outside it, is dropped. It returns the first drop or
// scatter failure.
func (l *memLink) landPieces(buf []byte, pieces []wire.StagedPiece) string {
	var why string
	note := func(s string) {
		if why == "" {
			why = s
		}
	}
	var dev Device
	var spans []Span
	var held []*gpuRegion
	from, end, off := 0, 0, 0 // the stretch is buf[from:end]
	flush := func() {
		if len(spans) > 0 {
			if err := dev.Scatter(spans, buf[from:end]); err != nil {
				note("scatter into GPU memory: " + err.Error())
			}
		}
		for _, r := range held {
			r.use.RUnlock()
		}
		spans, held = spans[:0], held[:0]
	}
	for _, pc := range pieces {
		at := off
		off += int(pc.N)
		var gr *gpuRegion
		var hr *memRegion
		if i := slices.IndexFunc(held, func(r *gpuRegion) bool { return r.id == pc.Region }); i >= 0 {
			gr = held[i]
		} else {
			gr, hr = l.p.regionOf(pc.Region)
		}
		switch {
		case gr != nil:
			if len(spans) == 0 || gr.dev != dev || end != at {
				flush()
				dev, from = gr.dev, at
			}
			// Locked once per stretch: locking it again on this goroutine
			// could deadlock behind a waiting unregister.
			if !slices.Contains(held, gr) {
				gr.use.RLock()
				held = append(held, gr)
			}
			if !gr.gone && fits(pc, gr.n) {
				spans, end = append(spans, Span{Addr: gr.ptr + pc.Offset, Len: uint64(pc.N)}), off
				continue
			}
		case hr != nil:
			hr.use.RLock()
			ok := !hr.gone && fits(pc, uint64(len(hr.mem)))
			if ok {
				copy(hr.mem[pc.Offset:], buf[at:off])
			}
			hr.use.RUnlock()
			if ok {
				continue
			}
		}
		note(fmt.Sprintf("destination region %d [%d,+%d) is not registered (any more)", pc.Region, pc.Offset, pc.N))
	}
	flush()
	return why
}

// fits reports whether pc lies inside a region of size bytes.
func fits(pc wire.StagedPiece, size uint64) bool {
	return pc.Offset <= size && uint64(pc.N) <= size-pc.Offset
}

// regionOf is this plane's region with id: a GPU or a host one (neither:
// gone).
func (p *MemoryPlane) regionOf(id uint32) (*gpuRegion, *memRegion) {
	p.mu.Lock()
	hr := p.byID[id]
	p.mu.Unlock()
	if hr != nil {
		return nil, hr
	}
	return p.gpu.byID(id), nil
}
