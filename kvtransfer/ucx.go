//go:build cgo

package kvtransfer

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"unsafe"

	"github.com/pdrouter/pdrouter/kvtransfer/shm"
	"github.com/pdrouter/pdrouter/kvtransfer/wire"
	"github.com/pdrouter/pdrouter/ucx"
)

// UCX is the zero-copy transport. The pool is one segment UCX allocates
// (UCP_MEM_MAP_ALLOCATE) when its allocator gives shared memory (posix in
// UCX_TLS), so a peer's put over shared memory is a direct store into it;
// UCX 1.13's shm transports cannot register foreign memory, and puts into
// a registered memfd fall back to active-message emulation. Without a shm
// allocator (UCX_TLS=tcp) the pool is a memfd registered per region.
// Remote keys are unpacked once per peer and distinct key; a chunk is one
// batch of puts per (local, remote) registration (one cgo call each) plus
// one endpoint flush. One UCX worker, owned by a ucx.Loop goroutine locked
// to its OS thread, serves every peer and also progresses incoming
// transfers on the decode side.
type UCX struct {
	ctx   *ucx.Context
	loop  *ucx.Loop
	alloc *ucx.Memory // the UCX-allocated pool segment, if any
	owned []*ucx.Memory
	// per region: its registration and its offset inside it
	mems []*ucx.Memory
	offs []uint64
	// flushes in flight; touched only on the loop goroutine.
	pending []pendingFlush
}

type pendingFlush struct {
	req  *ucx.Request
	done chan error
}

var _ Transport = (*UCX)(nil)

// NewUCX creates the UCX context (UCX_* environment applies) and its worker.
// When UCX_TLS allows shared memory, endpoints use error handling mode NONE:
// UCX 1.13 leaves the posix and sysv lanes out of PEER-mode endpoints, which
// would force every put onto tcp; a dead peer is detected by the engine's
// heartbeats instead. Over tcp alone they keep mode PEER: with NONE, UCX
// 1.13 crashed (SIGSEGV) once a second context of the process connected
// over tcp (BenchmarkUCXWrite/tcp reproduced it).
func NewUCX() (*UCX, error) {
	cfg := ucx.Config{NoPeerErrorHandling: shmAllowed(os.Getenv("UCX_TLS")), Options: map[string]string{}}
	if os.Getenv("UCX_ALLOC_PRIO") == "" {
		// posix before sysv: a posix segment is a file whose fd the engine
		// can map; a sysv one has no fd.
		cfg.Options["ALLOC_PRIO"] = "md:posix,md:sysv,huge,thp,md:*,mmap,heap"
	}
	ctx, err := ucx.NewContext(cfg)
	if err != nil {
		return nil, err
	}
	u := &UCX{ctx: ctx}
	if u.loop, err = ucx.NewLoop(ctx, ucx.LoopConfig{Mode: ucx.ThreadSingle, Poll: u.poll}); err != nil {
		ctx.Close()
		return nil, err
	}
	return u, nil
}

// shmAllowed reports whether a UCX_TLS value can select a shared-memory
// transport (unset, "all", an exclusion list, or a shm transport named).
func shmAllowed(tls string) bool {
	if tls == "" || strings.HasPrefix(tls, "^") {
		return true
	}
	for _, t := range strings.Split(tls, ",") {
		switch strings.TrimSpace(t) {
		case "all", "sm", "shm", "posix", "sysv", "cma", "knem", "xpmem":
			return true
		}
	}
	return false
}

// poll completes finished flushes; it runs on the loop goroutine.
func (u *UCX) poll(*ucx.Worker) bool {
	keep := u.pending[:0]
	for _, p := range u.pending {
		done, err := p.req.Test()
		if !done {
			keep = append(keep, p)
			continue
		}
		p.req.Free()
		p.done <- err
	}
	clear(u.pending[len(keep):])
	u.pending = keep
	return len(keep) > 0
}

func (*UCX) Name() string { return "ucx" }

// Alloc lets UCX allocate the pool and finds the file behind it; when UCX's
// memory is not a shared file (no posix allocator), it makes a memfd.
func (u *UCX) Alloc(size int) (*shm.Segment, error) {
	if u.alloc != nil {
		return nil, errors.New("ucx: pool already allocated")
	}
	m, err := u.ctx.Alloc(size)
	if err != nil {
		return nil, err
	}
	seg, err := shm.Find(m.Bytes())
	if errors.Is(err, shm.ErrNotShared) {
		if err := m.Close(); err != nil {
			return nil, err
		}
		return shm.Create("kvpool", size)
	}
	if err != nil {
		m.Close()
		return nil, err
	}
	u.alloc = m
	u.owned = append(u.owned, m)
	return seg, nil
}

func (u *UCX) Register(p *Pool) (LocalMeta, error) {
	var meta LocalMeta
	var allocKey []byte
	for i, r := range p.Regions {
		m, off, err := u.registration(r.Mem)
		if err != nil {
			return LocalMeta{}, fmt.Errorf("region %d: %w", i, err)
		}
		// Regions of the allocated segment share its key: peers unpack
		// (and attach the segment) once.
		rk := allocKey
		if m != u.alloc || rk == nil {
			if rk, err = m.PackRkey(); err != nil {
				return LocalMeta{}, fmt.Errorf("region %d: %w", i, err)
			}
		}
		if m == u.alloc {
			allocKey = rk
		}
		u.mems, u.offs = append(u.mems, m), append(u.offs, off)
		meta.Bases = append(meta.Bases, m.Addr()+off)
		meta.RKeys = append(meta.RKeys, rk)
	}
	err := u.loop.Do(func(w *ucx.Worker) error {
		a, err := w.Address()
		meta.WorkerAddr = a
		return err
	})
	return meta, err
}

// registration returns the registered memory holding b and b's offset in
// it: the allocated segment, or a new registration of b.
func (u *UCX) registration(b []byte) (*ucx.Memory, uint64, error) {
	if a := u.alloc; a != nil {
		addr, n := uint64(uintptr(unsafe.Pointer(unsafe.SliceData(b)))), uint64(len(b))
		if addr >= a.Addr() && addr+n <= a.Addr()+uint64(a.Len()) {
			return a, addr - a.Addr(), nil
		}
	}
	m, err := u.ctx.Map(b)
	if err != nil {
		return nil, 0, err
	}
	u.owned = append(u.owned, m)
	return m, 0, nil
}

func (u *UCX) Connect(remote *wire.Hello, _ *wire.Conn) (Writer, error) {
	if len(remote.Regions) != len(u.mems) {
		return nil, fmt.Errorf("ucx: peer has %d regions, %d registered here", len(remote.Regions), len(u.mems))
	}
	w := &ucxWriter{ucxEndpoint: ucxEndpoint{u: u}, remote: remote}
	err := u.loop.Do(func(wk *ucx.Worker) error {
		ep, err := wk.ConnectAddress(remote.WorkerAddr)
		if err != nil {
			return err
		}
		w.ep = ep
		byKey := map[string]*ucx.Rkey{}
		for i, r := range remote.Regions {
			rk := byKey[string(r.RKey)]
			if rk == nil {
				if rk, err = ep.UnpackRkey(r.RKey); err != nil {
					ep.Close()
					return fmt.Errorf("region %d rkey: %w", i, err)
				}
				byKey[string(r.RKey)] = rk
			}
			w.rkeys = append(w.rkeys, rk)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("ucx connect: %w", err)
	}
	return w, nil
}

// Done is closed when the worker's loop stops: on Close, or on a worker
// error (a failed endpoint only fails its own peer's writes).
func (u *UCX) Done() <-chan struct{} { return u.loop.Done() }

func (u *UCX) Err() error { return u.loop.Err() }

// Close stops the worker and unregisters the pool; call after every Writer
// is closed.
func (u *UCX) Close() error {
	err := u.loop.Close()
	for _, m := range u.owned {
		err = errors.Join(err, m.Close())
	}
	return errors.Join(err, u.ctx.Close())
}

// ucxEndpoint is an endpoint to one peer worker that writes are posted on:
// a room writer's or a memory endpoint's. ep and closed belong to the loop
// goroutine.
type ucxEndpoint struct {
	u      *UCX
	ep     *ucx.Endpoint
	closed bool
}

type ucxWriter struct {
	ucxEndpoint
	remote *wire.Hello
	rkeys  []*ucx.Rkey // per region; regions of one peer segment share one
}

// batch is the puts between one local registration and one remote key,
// addressed absolutely on the remote side.
type batch struct {
	mem *ucx.Memory
	rk  *ucx.Rkey
	ops []ucx.Op
}

func (w *ucxWriter) Write(ctx context.Context, runs []Run) error {
	if len(runs) == 0 {
		return nil
	}
	// Group the runs by (local registration, remote key) so that pools
	// that are one segment on both sides post the whole chunk in one call.
	var batches []batch
	for _, r := range runs {
		op := ucx.Op{LocalOff: w.u.offs[r.Region] + r.SrcOff, RemoteOff: w.remote.Regions[r.Region].Base + r.DstOff, Len: r.Len}
		batches = addToBatch(batches, w.u.mems[r.Region], w.rkeys[r.Region], op)
	}
	return w.write(ctx, batches)
}

// addToBatch appends op to the batch of (m, rk), starting one if needed.
func addToBatch(batches []batch, m *ucx.Memory, rk *ucx.Rkey, op ucx.Op) []batch {
	i := 0
	for i < len(batches) && (batches[i].mem != m || batches[i].rk != rk) {
		i++
	}
	if i == len(batches) {
		batches = append(batches, batch{mem: m, rk: rk})
	}
	batches[i].ops = append(batches[i].ops, op)
	return batches
}

// write posts the batches and one endpoint flush, then waits for the flush
// or for ctx to end (peer lost, deadline).
func (e *ucxEndpoint) write(ctx context.Context, batches []batch) error {
	done := make(chan error, 1)
	err := e.u.loop.Submit(func(*ucx.Worker) {
		if e.closed {
			done <- ucx.ErrClosed
			return
		}
		posted, err := e.u.post(e.ep, batches, done)
		if err != nil {
			if posted { // stop the puts in flight: they read our memory
				e.abortOnLoop()
			}
			done <- err
		}
	})
	if err != nil {
		return err
	}
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
	}
	// The peer is dead or stuck (with error handling mode NONE nothing
	// ever fails the flush): drop the endpoint and give up the flush, so no
	// put of ours stays queued against our memory and the loop stops
	// polling a request that will never complete.
	err = e.u.loop.Do(func(*ucx.Worker) error {
		e.abortOnLoop()
		e.u.dropFlush(done)
		return nil
	})
	return errors.Join(ctx.Err(), err)
}

// dropFlush frees the pending flush that reports to done, if it is still
// pending; on the loop goroutine.
func (u *UCX) dropFlush(done chan error) {
	for i, p := range u.pending {
		if p.done == done {
			p.req.Free()
			u.pending = append(u.pending[:i], u.pending[i+1:]...)
			return
		}
	}
}

// abortOnLoop aborts the endpoint: every write on it has ended or is
// failing (each waits for its own flush), so a graceful flush would only
// hold the loop for a dead peer. Its rkeys go with it.
func (e *ucxEndpoint) abortOnLoop() {
	if !e.closed {
		e.closed = true
		_ = e.ep.Abort()
	}
}

func (e *ucxEndpoint) Close() {
	_ = e.u.loop.Do(func(*ucx.Worker) error {
		e.abortOnLoop()
		return nil
	})
}

// post puts every batch (one cgo call each) and one endpoint flush, whose
// completion goes to done; on the loop goroutine. On error, posted says
// whether some puts are in flight anyway.
func (u *UCX) post(ep *ucx.Endpoint, batches []batch, done chan error) (posted bool, err error) {
	for _, b := range batches {
		req, err := ep.PutBatch(b.mem, b.rk, 0, b.ops)
		if err != nil {
			return posted, err
		}
		posted = true
		req.Free() // the flush below covers it
	}
	req, err := ep.Flush()
	if err != nil {
		return posted, err
	}
	u.pending = append(u.pending, pendingFlush{req: req, done: done})
	return false, nil
}

var _ MemoryTransport = (*UCX)(nil)

// ucxRegistration is a mapping of engine memory registered with
// ucp_mem_map; peers put into it under its packed key.
type ucxRegistration struct {
	m    *ucx.Memory
	rkey []byte
}

func (r *ucxRegistration) RKey() []byte { return r.rkey }
func (r *ucxRegistration) Close() error { return r.m.Close() }

func (u *UCX) RegisterMemory(b []byte, _ int) (MemoryRegistration, error) {
	m, err := u.ctx.Map(b)
	if err != nil {
		return nil, err
	}
	rk, err := m.PackRkey()
	if err != nil {
		return nil, errors.Join(err, m.Close())
	}
	return &ucxRegistration{m: m, rkey: rk}, nil
}

// ZeroCopyRMA reports whether UCX reaches peers over a transport that puts
// straight from registered memory (InfiniBand or RoCE: rc, dc). Over tcp and
// shared memory UCX emulates puts with active messages (and UCX 1.13 cannot
// register memory kvproxy mapped from another process): 0.15–0.48 GB/s
// where DATA frames on the peer link moved 0.8–1.0 (bench/RESULTS.md,
// kv-sglang), so host memory then takes those.
func (u *UCX) ZeroCopyRMA() bool {
	tls, err := u.ctx.Transports()
	if err != nil {
		return false
	}
	for _, tl := range tls {
		name, _, _ := strings.Cut(tl, "/")
		if strings.HasPrefix(name, "rc") || strings.HasPrefix(name, "dc") {
			return true
		}
	}
	return false
}

func (u *UCX) WorkerAddress() ([]byte, error) {
	var a []byte
	err := u.loop.Do(func(w *ucx.Worker) error {
		var err error
		a, err = w.Address()
		return err
	})
	return a, err
}

func (u *UCX) MemoryEndpoint(addr []byte) (MemoryEndpoint, error) {
	e := &ucxMemEndpoint{ucxEndpoint{u: u}}
	err := u.loop.Do(func(w *ucx.Worker) error {
		var err error
		e.ep, err = w.ConnectAddress(addr)
		return err
	})
	if err != nil {
		return nil, err
	}
	return e, nil
}

// ucxMemEndpoint is one endpoint to a peer worker for memory writes.
type ucxMemEndpoint struct{ ucxEndpoint }

func (e *ucxMemEndpoint) Unpack(rkey []byte) (RemoteKey, error) {
	var rk *ucx.Rkey
	err := e.u.loop.Do(func(*ucx.Worker) error {
		if e.closed {
			return ucx.ErrClosed
		}
		var err error
		rk, err = e.ep.UnpackRkey(rkey)
		return err
	})
	return rk, err
}

// Put groups the ops by (local registration, remote key), posts one batch
// per group (one cgo call each) and one endpoint flush.
func (e *ucxMemEndpoint) Put(ctx context.Context, ops []MemoryOp) error {
	if len(ops) == 0 {
		return nil
	}
	var batches []batch
	for i, o := range ops {
		reg, ok1 := o.Local.(*ucxRegistration)
		rk, ok2 := o.Key.(*ucx.Rkey)
		if !ok1 || !ok2 {
			return fmt.Errorf("ucx put: op %d has a registration or key of another transport", i)
		}
		batches = addToBatch(batches, reg.m, rk, ucx.Op{LocalOff: o.LocalOff, RemoteOff: o.Remote, Len: o.Len})
	}
	return e.write(ctx, batches)
}

func (e *ucxMemEndpoint) Forget(k RemoteKey) {
	rk, ok := k.(*ucx.Rkey)
	if !ok {
		return
	}
	_ = e.u.loop.Do(func(*ucx.Worker) error {
		if !e.closed {
			rk.Close()
		}
		return nil
	})
}
