//go:build cgo

package kvtransfer

import (
	"context"
	"errors"
	"fmt"

	"github.com/pdrouter/pdrouter/kvtransfer/wire"
	"github.com/pdrouter/pdrouter/ucx"
)

// UCX is the zero-copy transport: regions are registered once (ucp_mem_map),
// their rkeys packed once and unpacked once per peer; a chunk is one batch of
// puts per region (one cgo call each) plus one endpoint flush. One UCX
// worker, owned by a ucx.Loop goroutine locked to its OS thread, serves every
// peer and also progresses incoming transfers on the decode side.
type UCX struct {
	ctx  *ucx.Context
	loop *ucx.Loop
	mems []*ucx.Memory
	// flushes in flight; touched only on the loop goroutine.
	pending []pendingFlush
}

type pendingFlush struct {
	req  *ucx.Request
	done chan error
}

var _ Transport = (*UCX)(nil)

// NewUCX creates the UCX context (UCX_* environment applies) and its worker.
func NewUCX() (*UCX, error) {
	ctx, err := ucx.NewContext(ucx.Config{})
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

func (u *UCX) Register(p *Pool) (LocalMeta, error) {
	var meta LocalMeta
	for i, r := range p.Regions {
		m, err := u.ctx.Map(r.Mem)
		if err != nil {
			return LocalMeta{}, fmt.Errorf("region %d: %w", i, err)
		}
		u.mems = append(u.mems, m)
		rk, err := m.PackRkey()
		if err != nil {
			return LocalMeta{}, fmt.Errorf("region %d: %w", i, err)
		}
		meta.Bases = append(meta.Bases, m.Addr())
		meta.RKeys = append(meta.RKeys, rk)
	}
	err := u.loop.Do(func(w *ucx.Worker) error {
		a, err := w.Address()
		meta.WorkerAddr = a
		return err
	})
	return meta, err
}

func (u *UCX) Connect(remote *wire.Hello, _ *wire.Conn) (Writer, error) {
	if len(remote.Regions) != len(u.mems) {
		return nil, fmt.Errorf("ucx: peer has %d regions, %d registered here", len(remote.Regions), len(u.mems))
	}
	w := &ucxWriter{u: u, remote: remote}
	err := u.loop.Do(func(wk *ucx.Worker) error {
		ep, err := wk.ConnectAddress(remote.WorkerAddr)
		if err != nil {
			return err
		}
		w.ep = ep
		for i, r := range remote.Regions {
			rk, err := ep.UnpackRkey(r.RKey)
			if err != nil {
				ep.Close()
				return fmt.Errorf("region %d rkey: %w", i, err)
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

// Close stops the worker and unregisters the pool; call after every Writer
// is closed.
func (u *UCX) Close() error {
	err := u.loop.Close()
	for _, m := range u.mems {
		err = errors.Join(err, m.Close())
	}
	return errors.Join(err, u.ctx.Close())
}

type ucxWriter struct {
	u      *UCX
	remote *wire.Hello
	ep     *ucx.Endpoint
	rkeys  []*ucx.Rkey
}

func (w *ucxWriter) Write(ctx context.Context, runs []Run) error {
	if len(runs) == 0 {
		return nil
	}
	// Runs come grouped by merged page run; regroup them by region so each
	// region is one PutBatch.
	ops := make([][]ucx.Op, len(w.rkeys))
	for _, r := range runs {
		ops[r.Region] = append(ops[r.Region], ucx.Op{LocalOff: r.SrcOff, RemoteOff: r.DstOff, Len: r.Len})
	}
	done := make(chan error, 1)
	err := w.u.loop.Submit(func(*ucx.Worker) {
		for ri, o := range ops {
			if len(o) == 0 {
				continue
			}
			req, err := w.ep.PutBatch(w.u.mems[ri], w.rkeys[ri], w.remote.Regions[ri].Base, o)
			if err != nil {
				done <- err
				return
			}
			req.Free() // the flush below covers it
		}
		req, err := w.ep.Flush()
		if err != nil {
			done <- err
			return
		}
		w.u.pending = append(w.u.pending, pendingFlush{req: req, done: done})
	})
	if err != nil {
		return err
	}
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (w *ucxWriter) Close() {
	_ = w.u.loop.Do(func(*ucx.Worker) error { return w.ep.Close() })
}
