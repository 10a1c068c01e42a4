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

// localPeer is peer region r opened in the context of the device its
// memory is on (one src cannot reach): its address there and that device.
// Call with pmu read-held.
func (g *gpuPlane) localPeer(l *memLink, r wire.MemRegion, src Device) (uint64, Device, error) {
	h, off, _, host, err := parseGPUKey(r.RKey)
	if err != nil {
		return 0, nil, err
	}
	if host != g.host {
		return 0, nil, fmt.Errorf("peer region %d is on host %q, not this one", r.ID, host)
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if pr, ok := g.localEntryLocked(l, r.ID, src); ok {
		return pr.ptr, pr.imp.dev, nil
	}
	imp, err := g.importOwnLocked(h)
	if err != nil {
		return 0, nil, fmt.Errorf("open peer region %d's IPC handle: %w", r.ID, err)
	}
	k := gpuPeerKey{l, r.ID, imp.dev.Ordinal()}
	if pr, ok := g.peers[k]; ok {
		return pr.ptr, pr.imp.dev, g.releaseLocked(imp)
	}
	if imp.size != 0 && off+r.Len > imp.size {
		return 0, nil, errors.Join(fmt.Errorf("peer region %d runs past its allocation", r.ID), g.releaseLocked(imp))
	}
	g.peers[k] = gpuPeer{imp, imp.ptr + off}
	return imp.ptr + off, imp.dev, nil
}

// stagedLocally reports whether peer region id (behind l) is already
// opened for the local staged path from dev: on a device dev cannot
// reach. Without it every write would first try, and fail, to open the
// region in dev's context.
func (g *gpuPlane) stagedLocally(l *memLink, id uint32, dev Device) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	_, ok := g.localEntryLocked(l, id, dev)
	return ok
}

// localEntryLocked is peer region id opened by localPeer for writes from
// dev: the one mapping of it on a device dev cannot reach.
func (g *gpuPlane) localEntryLocked(l *memLink, id uint32, dev Device) (gpuPeer, bool) {
	for k, pr := range g.peers {
		if k.l == l && k.id == id && k.dev != dev.Ordinal() && !g.devs.gpus.PeerAccess(dev.Ordinal(), k.dev) {
			return pr, true
		}
	}
	return gpuPeer{}, false
}

// localTarget is a destination region opened here.
type localTarget struct {
	ptr uint64
	dev Device
}

// copyStagedLocal moves runs (sources on pool's device) into GPU regions of
// this host through pool's staging buffers: gathering chunk N+1 overlaps
// scattering chunk N. It returns once the last scatter is done.
func (g *gpuPlane) copyStagedLocal(ctx context.Context, l *memLink, pool *stagePool, chunk int, runs []stagedRun) error {
	g.pmu.RLock()
	defer g.pmu.RUnlock()
	dsts := map[uint32]localTarget{}
	for _, r := range runs {
		if _, ok := dsts[r.dst]; ok {
			continue
		}
		pr, ok := l.regionByID(r.dst)
		if !ok {
			return fmt.Errorf("peer region %d: %w at the peer", r.dst, ErrNotRegistered)
		}
		ptr, dev, err := g.localPeer(l, pr, pool.dev)
		if err != nil {
			return err
		}
		dsts[r.dst] = localTarget{ptr, dev}
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
func scatterLocal(c stagedChunk, dsts map[uint32]localTarget) error {
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
		if t.dev != dev {
			if err := flush(); err != nil {
				return err
			}
			dev = t.dev
		}
		spans = append(spans, Span{Addr: t.ptr + p.Offset, Len: uint64(p.N)})
		off += int(p.N)
	}
	return flush()
}
