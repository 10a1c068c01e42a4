//go:build cgo

package kvtransfer

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"

	"github.com/pdrouter/pdrouter/ucx"
)

// UCX moves engine memory by RMA: each registered mapping is registered
// with ucp_mem_map once and its packed key sent to peers once; a peer
// unpacks it once per endpoint. A write is one batch of puts per (local
// registration, remote key) (one cgo call each) plus one endpoint flush.
// UCX 1.13's shared-memory transports cannot register foreign memory, so
// over posix/sysv puts fall back to active messages: the shm transport
// copies directly instead. One UCX worker, owned by a ucx.Loop goroutine
// locked to its OS thread, serves every peer and also progresses incoming
// transfers.
type UCX struct {
	ctx  *ucx.Context
	loop *ucx.Loop
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
		// posix before sysv, as when UCX allocated the pool: UCX's own
		// shared-memory buffers keep the allocator the memory plane's
		// writes over posix were measured with.
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
	u.pending = slices.DeleteFunc(u.pending, func(p pendingFlush) bool {
		done, err := p.req.Test()
		if done {
			p.req.Free()
			p.done <- err
		}
		return done
	})
	return len(u.pending) > 0
}

func (*UCX) Name() string { return "ucx" }

// Done is closed when the worker's loop stops: on Close, or on a worker
// error (a failed endpoint only fails its own peer's writes).
func (u *UCX) Done() <-chan struct{} { return u.loop.Done() }

func (u *UCX) Err() error { return u.loop.Err() }

// Close stops the worker; call after every registration and endpoint is
// closed.
func (u *UCX) Close() error {
	return errors.Join(u.loop.Close(), u.ctx.Close())
}

// ucxEndpoint is an endpoint to one peer worker that writes are posted on.
// ep and closed belong to the loop goroutine.
type ucxEndpoint struct {
	u      *UCX
	ep     *ucx.Endpoint
	closed bool
}

// batch is the puts between one local registration and one remote key,
// addressed absolutely on the remote side.
type batch struct {
	mem *ucx.Memory
	rk  *ucx.Rkey
	ops []ucx.Op
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

// Put groups the ops by (local registration, remote key), posts one batch
// per group (one cgo call each) and one endpoint flush, then waits for the
// flush or for ctx to end (peer lost, deadline).
func (e *ucxEndpoint) Put(ctx context.Context, ops []MemoryOp) error {
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
	if i := slices.IndexFunc(u.pending, func(p pendingFlush) bool { return p.done == done }); i >= 0 {
		u.pending[i].req.Free()
		u.pending = slices.Delete(u.pending, i, i+1)
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
	e := &ucxEndpoint{u: u}
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

func (e *ucxEndpoint) Unpack(rkey []byte) (RemoteKey, error) {
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

func (e *ucxEndpoint) Forget(k RemoteKey) {
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
