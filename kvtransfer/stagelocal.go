package kvtransfer

import (
	"context"
	"errors"
	"fmt"

	"github.com/pdrouter/pdrouter/kvtransfer/wire"
)

// Staged-local: between two devices of this host without peer access, the
// writing kvproxy opens the destination engine's allocation in the context
// of the device it lives on and scatters each gathered chunk into it
// itself. No byte crosses a socket.

// localDest reports whether peer region id (behind l) is GPU memory of
// this host: the staged path to it is the local one.
func (g *gpuPlane) localDest(l *memLink, id uint32) bool {
	r, ok := l.regionByID(id)
	pl := peerPlace(r)
	return ok && pl.Kind == wire.MemCUDA && pl.Host == g.host
}

// regionByID is the peer region with id in l's table.
func (l *memLink) regionByID(id uint32) (wire.MemRegion, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, r := range l.regions {
		if r.ID == id {
			return r, true
		}
	}
	return wire.MemRegion{}, false
}

// copyStagedLocal moves runs (sources on pool's device) into GPU regions of
// this host through pool's staging buffers: gathering chunk N+1 overlaps
// scattering chunk N. It returns once the last scatter is done.
func (g *gpuPlane) copyStagedLocal(ctx context.Context, l *memLink, pool *stagePool, chunk int, runs []stagedRun) error {
	g.pmu.RLock()
	defer g.pmu.RUnlock()
	dsts := map[uint32]gpuPeer{}
	for _, r := range runs {
		if _, ok := dsts[r.dst]; ok {
			continue
		}
		pr, ok := l.regionByID(r.dst)
		if !ok {
			return fmt.Errorf("peer region %d: %w at the peer", r.dst, ErrNotRegistered)
		}
		g.mu.Lock()
		dst, err := g.peerLocked(l, pr, pool.dev)
		g.mu.Unlock()
		if errors.Is(err, errStaged) {
			err = fmt.Errorf("peer region %d is no GPU memory of this host", r.dst)
		}
		if err != nil {
			return err
		}
		dsts[r.dst] = dst
	}
	serr, gerr := pipeline(ctx, pool, chunk, runs, func(c stagedChunk) error {
		return errors.Join(scatterLocal(c, dsts), pool.put(c.buf))
	})
	switch {
	case serr != nil:
		return fmt.Errorf("scatter into GPU memory: %w", serr)
	case gerr != nil:
		return fmt.Errorf("gather: %w", gerr)
	}
	return ctx.Err()
}

// scatterLocal scatters a gathered chunk, one call per stretch of pieces
// bound for one device.
func scatterLocal(c stagedChunk, dsts map[uint32]gpuPeer) error {
	var spans []Span
	var dev Device
	from, off := 0, 0
	flush := func() error {
		if len(spans) == 0 {
			return nil
		}
		err := dev.Scatter(spans, c.buf[from:off])
		spans, from = spans[:0], off
		return err
	}
	for _, p := range c.pieces {
		t := dsts[p.Region]
		if t.imp.dev != dev {
			if err := flush(); err != nil {
				return err
			}
			dev = t.imp.dev
		}
		spans = append(spans, Span{Addr: t.ptr + p.Offset, Len: uint64(p.N)})
		off += int(p.N)
	}
	return flush()
}
