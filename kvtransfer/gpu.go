package kvtransfer

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"slices"
	"sync"
	"time"
	"unsafe"

	"github.com/pdrouter/pdrouter/cuda"
	"github.com/pdrouter/pdrouter/kvtransfer/wire"
)

// Engine GPU memory (issue 16). An engine registers device memory by the
// CUDA IPC handle of the allocation holding it plus the offset; the kvproxy
// opens the handle through the driver API. UCX cannot carry such memory:
// the driver refuses to export a mapping that was itself imported
// (cuIpcGetMemHandle: invalid argument, measured on the H200), and UCX's
// cuda_ipc rkeys are exactly such exports. So a cuda region's key in the
// peer table is the engine's own handle, and the writing kvproxy, on the
// same host, opens the peer engine's allocation itself and copies GPU to
// GPU on its own stream: one kernel launch per write for many runs (or a
// copy per run for a few), with contiguous runs merged. That is what UCX's
// cuda_ipc transport does inside, minus the re-export.

// gpuCopyMode forces the copier's mode (PDROUTER_CUDA_COPY=kernel|memcpy),
// staged gathers and scatters included, for benchmarks; the default picks
// per batch.
var gpuCopyMode = map[string]cuda.CopyMode{"kernel": cuda.CopyKernel, "memcpy": cuda.CopyMemcpy}[os.Getenv("PDROUTER_CUDA_COPY")]

// gpuPlane is a MemoryPlane's GPU state; its zero value opens the device on
// first use.
type gpuPlane struct {
	gpus GPUs
	dev  Device // where engines' allocations are opened (device 0)
	err  error
	host string // the plane's host id: peers' handles open only on the same host

	mu      sync.Mutex
	closed  bool           // set by close: no device opens, no region joins
	opened  map[int]Device // each device opened once, on first use, by ordinal
	regions []*gpuRegion   // sorted by base
	imports map[gpuImportKey]*gpuImport
	// peers maps a peer region (by link and ID) to where it is mapped here;
	// pmu is write-held to drop imports no peer table names any more.
	peers map[gpuPeerKey]gpuPeer
	seen  map[*memLink]*wire.MemRegion // the peer table each link was last pruned at
	pmu   sync.RWMutex
	pools map[int]*stagePool // staging buffers by device (staging.go)
}

type gpuPeerKey struct {
	l   *memLink
	id  uint32
	dev int // the writing device, whose context opened it
}

// gpuPeer is a peer region opened here: its import and its base address;
// local: opened in its own device's context, one the writer cannot reach.
type gpuPeer struct {
	imp   *gpuImport
	ptr   uint64
	local bool
}

// gpuImport is one opened IPC handle, shared by the regions inside it.
type gpuImport struct {
	h    cuda.Handle
	dev  Device // the context it was opened in
	ptr  uint64 // the mapping's base in this process
	size uint64 // 0: unknown
	refs int
}

// gpuImportKey: a handle is opened once per device context.
type gpuImportKey struct {
	h   cuda.Handle
	dev int
}

// gpuRegion is one registered GPU region.
type gpuRegion struct {
	id        uint32
	base, n   uint64     // engine address range
	handleOff uint64     // base minus the allocation's base
	imp       *gpuImport // the allocation's handle, opened
	owner     *MemorySession
	use       sync.RWMutex
	gone      bool
	ptr       uint64 // base's address in this process
	dev       Device // the device the memory is on
}

func (r *gpuRegion) end() uint64 { return r.base + r.n }

// openLocked opens device 0 on first use; a failure sticks.
func (g *gpuPlane) openLocked(p *MemoryPlane) error {
	if g.dev == nil && g.err == nil {
		g.gpus, g.host = p.cfg.GPUs, p.host
		g.imports, g.peers, g.seen = map[gpuImportKey]*gpuImport{}, map[gpuPeerKey]gpuPeer{}, map[*memLink]*wire.MemRegion{}
		g.dev, g.err = g.deviceLocked(0)
	}
	return g.err
}

// importLocked opens h in dev's context (once per process and device) and
// takes a reference.
func (g *gpuPlane) importLocked(dev Device, h cuda.Handle) (*gpuImport, error) {
	k := gpuImportKey{h, dev.Ordinal()}
	if imp := g.imports[k]; imp != nil {
		imp.refs++
		return imp, nil
	}
	ptr, err := dev.OpenIPC(h)
	if err != nil {
		return nil, err
	}
	// The allocation's size bounds registrations; 0 if the driver won't
	// say for an imported mapping (then the engine's ranges are trusted).
	imp := &gpuImport{h: h, dev: dev, ptr: ptr, refs: 1}
	if base, size, err := dev.AddressRange(ptr); err == nil && base == ptr {
		imp.size = uint64(size)
	}
	g.imports[k] = imp
	return imp, nil
}

// importHomeLocked opens h from dev's context first (peer access comes
// lazily) and, if its memory is on another device ord and stay(ord) is
// false, again in ord's context instead (moved).
func (g *gpuPlane) importHomeLocked(dev Device, h cuda.Handle, stay func(ord int) bool) (imp *gpuImport, moved bool, err error) {
	if imp, err = g.importLocked(dev, h); err != nil {
		return nil, false, err
	}
	ord, err := dev.Locate(imp.ptr)
	if err == nil && (ord == dev.Ordinal() || stay(ord)) {
		return imp, false, nil
	}
	var home Device
	if err == nil {
		home, err = g.deviceLocked(ord)
	}
	if rerr := g.releaseLocked(imp); err != nil || rerr != nil {
		return nil, false, errors.Join(err, rerr)
	}
	if imp, err = g.importLocked(home, h); err != nil {
		return nil, false, fmt.Errorf("on GPU %d: %w", ord, err)
	}
	return imp, true, nil
}

func (g *gpuPlane) releaseLocked(imp *gpuImport) error {
	if imp.refs--; imp.refs > 0 {
		return nil
	}
	delete(g.imports, gpuImportKey{imp.h, imp.dev.Ordinal()})
	return imp.dev.CloseIPC(imp.ptr)
}

// RegisterCUDA registers device memory [addr, addr+length) of the engine,
// which lies handleOffset bytes into the allocation whose IPC handle is
// handle. Registering the identical range again replaces it.
func (s *MemorySession) RegisterCUDA(addr, length uint64, handle []byte, handleOffset uint64) error {
	p, g := s.p, &s.p.gpu
	switch {
	case len(handle) != cuda.HandleSize:
		return fmt.Errorf("register cuda memory: handle of %d bytes, want %d", len(handle), cuda.HandleSize)
	case length == 0 || addr+length < addr || handleOffset > addr:
		return fmt.Errorf("register cuda memory: bad range [%#x,+%d) at offset %d", addr, length, handleOffset)
	case length > maxMemoryRegion:
		return fmt.Errorf("register cuda memory: %d bytes is too large", length)
	}
	var h cuda.Handle
	copy(h[:], handle)
	// The ID comes first: table() holds p.mu while it takes g.mu.
	p.mu.Lock()
	closed := p.closed
	p.nextID++
	id := p.nextID
	p.mu.Unlock()
	if closed {
		return ErrClosed
	}
	// The device opens under mu, which close takes first: one opened after
	// close would never be closed (and close's drop would miss this region).
	g.mu.Lock()
	err := ErrClosed
	if !g.closed {
		err = g.openLocked(p)
	}
	if err != nil {
		g.mu.Unlock()
		return fmt.Errorf("register cuda memory: %w", err)
	}
	var replaced *gpuRegion
	for _, r := range g.regions {
		if r.base < addr+length && addr < r.end() {
			if r.base != addr || r.n != length || r.owner != s || replaced != nil {
				g.mu.Unlock()
				return fmt.Errorf("register cuda memory: [%#x,+%d) overlaps registered [%#x,+%d)", addr, length, r.base, r.n)
			}
			replaced = r
		}
	}
	imp, _, err := g.importHomeLocked(g.dev, h, func(int) bool { return false })
	if err != nil {
		g.mu.Unlock()
		return fmt.Errorf("register cuda memory: open IPC handle: %w", err)
	}
	if imp.size != 0 && handleOffset+length > imp.size {
		err := g.releaseLocked(imp)
		g.mu.Unlock()
		return errors.Join(fmt.Errorf("register cuda memory: [%d,+%d) runs past the %d-byte allocation", handleOffset, length, imp.size), err)
	}
	r := &gpuRegion{id: id, base: addr, n: length, handleOff: handleOffset, imp: imp, owner: s, ptr: imp.ptr + handleOffset, dev: imp.dev}
	if replaced != nil {
		g.regions = slices.DeleteFunc(g.regions, func(x *gpuRegion) bool { return x == replaced })
	}
	i, _ := slices.BinarySearchFunc(g.regions, addr, func(r *gpuRegion, a uint64) int { return cmpU64(r.base, a) })
	g.regions = slices.Insert(g.regions, i, r)
	g.mu.Unlock()
	p.m.regions.Inc()
	p.m.bytes.Add(float64(length))
	if replaced == nil {
		return nil
	}
	err = g.release(p, replaced)
	p.pushTable()
	return err
}

// release waits for writes using r, then closes its handle reference.
func (g *gpuPlane) release(p *MemoryPlane, r *gpuRegion) error {
	r.use.Lock()
	r.gone = true
	r.use.Unlock()
	g.mu.Lock()
	err := g.releaseLocked(r.imp)
	g.mu.Unlock()
	p.m.regions.Dec()
	p.m.bytes.Sub(float64(r.n))
	return err
}

// drop drops the GPU regions match picks (then, with push, tells peers)
// and reports whether there were any.
func (g *gpuPlane) drop(p *MemoryPlane, push bool, match func(*gpuRegion) bool) (bool, error) {
	g.mu.Lock()
	var gone []*gpuRegion
	g.regions = slices.DeleteFunc(g.regions, func(r *gpuRegion) bool {
		if match(r) {
			gone = append(gone, r)
			return true
		}
		return false
	})
	g.mu.Unlock()
	var err error
	for _, r := range gone {
		err = errors.Join(err, g.release(p, r))
	}
	if push && len(gone) > 0 {
		p.pushTable()
	}
	return len(gone) > 0, err
}

// deviceLocked opens device ordinal once, on first use.
func (g *gpuPlane) deviceLocked(ordinal int) (Device, error) {
	if d := g.opened[ordinal]; d != nil {
		return d, nil
	}
	d, err := g.gpus.Open(ordinal)
	if err != nil {
		return nil, fmt.Errorf("open GPU %d: %w", ordinal, err)
	}
	if g.opened == nil {
		g.opened = map[int]Device{}
	}
	g.opened[ordinal] = d
	return d, nil
}

// close drops every region and peer import, then frees the staging memory
// (staging.go) and the devices it is pinned on.
func (g *gpuPlane) close(p *MemoryPlane) error {
	g.mu.Lock()
	g.closed = true
	g.mu.Unlock()
	_, err := g.drop(p, false, func(*gpuRegion) bool { return true })
	g.pmu.Lock()
	defer g.pmu.Unlock()
	g.mu.Lock()
	defer g.mu.Unlock()
	for k, pr := range g.peers {
		delete(g.peers, k)
		err = errors.Join(err, g.releaseLocked(pr.imp))
	}
	for o, sp := range g.pools {
		err = errors.Join(err, sp.close())
		delete(g.pools, o)
	}
	for o, d := range g.opened {
		err = errors.Join(err, d.Close())
		delete(g.opened, o)
	}
	return err
}

// find returns the region holding [addr, addr+n), or nil.
func (g *gpuPlane) find(addr, n uint64) *gpuRegion {
	g.mu.Lock()
	defer g.mu.Unlock()
	i, _ := slices.BinarySearchFunc(g.regions, addr+1, func(r *gpuRegion, a uint64) int { return cmpU64(r.base, a) })
	if i == 0 {
		return nil
	}
	r := g.regions[i-1]
	if addr+n < addr || addr+n > r.end() {
		return nil
	}
	return r
}

// route picks how a write whose first triple is t goes: the device its
// sources are on, and whether its destination needs the staged path.
func (g *gpuPlane) route(ctx context.Context, l *memLink, t Triple) (Device, bool, error) {
	src := g.find(t.Src, max(t.Len, 1))
	if src == nil {
		return nil, false, fmt.Errorf("source [%#x,+%d): %w here", t.Src, t.Len, ErrNotRegistered)
	}
	refreshed := false
	dst, err := l.lookup(ctx, t.Dst, max(t.Len, 1), &refreshed)
	if err != nil {
		return nil, false, err
	}
	if err := g.prune(l); err != nil {
		l.p.log.Warn("close peer GPU mappings: " + err.Error())
	}
	g.pmu.RLock()
	_, err = g.peerPtr(l, dst, src.dev)
	g.pmu.RUnlock()
	if errors.Is(err, errStaged) {
		return src.dev, true, nil
	}
	return src.dev, false, err
}

// byID returns the registered region with id, or nil.
func (g *gpuPlane) byID(id uint32) *gpuRegion {
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, r := range g.regions {
		if r.id == id {
			return r
		}
	}
	return nil
}

// holds reports whether the write's first source is GPU memory.
func (g *gpuPlane) holds(ts []Triple) bool {
	return len(ts) > 0 && g.find(ts[0].Src, max(ts[0].Len, 1)) != nil
}

// table lists the GPU regions for peers: the key is the engine's handle,
// the offset, the device (as this kvproxy numbers it) and the host id.
func (g *gpuPlane) table() []wire.MemRegion {
	g.mu.Lock()
	defer g.mu.Unlock()
	t := make([]wire.MemRegion, len(g.regions))
	for i, r := range g.regions {
		t[i] = wire.MemRegion{ID: r.id, Kind: wire.MemCUDA, Base: r.base, Len: r.n, Addr: r.ptr,
			RKey: gpuKey(r.imp.h, r.handleOff, r.dev.Ordinal(), g.host)}
	}
	return t
}

func gpuKey(h cuda.Handle, off uint64, dev int, host string) []byte {
	k := append(h[:], make([]byte, 12)...)
	binary.LittleEndian.PutUint64(k[cuda.HandleSize:], off)
	binary.LittleEndian.PutUint32(k[cuda.HandleSize+8:], uint32(dev))
	return append(k, host...)
}

func parseGPUKey(k []byte) (h cuda.Handle, off uint64, dev int, host string, err error) {
	if len(k) < cuda.HandleSize+12 {
		return h, 0, 0, "", fmt.Errorf("cuda region key of %d bytes", len(k))
	}
	copy(h[:], k)
	return h, binary.LittleEndian.Uint64(k[cuda.HandleSize:]), int(int32(binary.LittleEndian.Uint32(k[cuda.HandleSize+8:]))),
		string(k[cuda.HandleSize+12:]), nil
}

// peerPlace is where a peer region lives, as its table says.
func peerPlace(r wire.MemRegion) Place {
	if r.Kind == wire.MemCUDA {
		if _, _, dev, host, err := parseGPUKey(r.RKey); err == nil {
			return Place{Kind: r.Kind, Device: dev, Host: host}
		}
	}
	return Place{Kind: r.Kind, Device: -1}
}

// prune drops peer imports whose region left l's table (or whose link
// closed); called when l's table changed since the last write.
func (g *gpuPlane) prune(l *memLink) error {
	l.mu.Lock()
	cur := unsafe.SliceData(l.regions)
	ids := make(map[uint32]bool, len(l.regions))
	for _, r := range l.regions {
		ids[r.ID] = true
	}
	l.mu.Unlock()
	g.mu.Lock()
	same := g.seen[l] == cur
	g.mu.Unlock()
	if same {
		return nil
	}
	g.pmu.Lock()
	defer g.pmu.Unlock()
	g.mu.Lock()
	defer g.mu.Unlock()
	var err error
	for k, pr := range g.peers {
		if k.l == l && !ids[k.id] || k.l != l && k.l.isClosed() {
			delete(g.peers, k)
			err = errors.Join(err, g.releaseLocked(pr.imp))
		}
	}
	for x := range g.seen {
		if x.isClosed() {
			delete(g.seen, x)
		}
	}
	g.seen[l] = cur
	return err
}

func (l *memLink) isClosed() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.closed
}

// errStaged: the destination is not reachable from the source's device
// (another host, host memory, or a device without peer access), so the
// write goes by the staged path.
var errStaged = errors.New("destination needs the staged path")

// peerPtr returns where peer region r (behind l) is mapped in dev's
// context; errStaged if dev cannot reach it. Call with pmu read-held.
func (g *gpuPlane) peerPtr(l *memLink, r wire.MemRegion, dev Device) (uint64, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	pr, err := g.peerLocked(l, r, dev)
	if err == nil && pr.local {
		err = errStaged
	}
	return pr.ptr, err
}

// peerLocked returns peer region r (behind l) as writes from dev reach it,
// opening its engine's allocation on first use: in dev's context where dev
// can reach the memory, else (staged-local) in the context of the device
// it is on; errStaged where it is no GPU memory of this host. Call with pmu
// read-held.
func (g *gpuPlane) peerLocked(l *memLink, r wire.MemRegion, dev Device) (gpuPeer, error) {
	k := gpuPeerKey{l, r.ID, dev.Ordinal()}
	if pr, ok := g.peers[k]; ok {
		return pr, nil
	}
	if r.Kind != wire.MemCUDA {
		return gpuPeer{}, errStaged
	}
	h, off, _, host, err := parseGPUKey(r.RKey)
	if err != nil {
		return gpuPeer{}, err
	}
	if host != g.host {
		return gpuPeer{}, errStaged
	}
	imp, local, err := g.importHomeLocked(dev, h, func(ord int) bool { return g.gpus.PeerAccess(dev.Ordinal(), ord) })
	if err != nil {
		return gpuPeer{}, fmt.Errorf("open peer region %d's IPC handle: %w", r.ID, err)
	}
	if imp.size != 0 && off+r.Len > imp.size {
		return gpuPeer{}, errors.Join(fmt.Errorf("peer region %d runs past its allocation", r.ID), g.releaseLocked(imp))
	}
	g.peers[k] = gpuPeer{imp: imp, ptr: imp.ptr + off, local: local}
	return g.peers[k], nil
}

// gpuChunk: writes of more triples than this resolve in parts of this
// many, each queued on the GPU as soon as it is resolved, so resolving the
// next part overlaps copying this one.
const gpuChunk = 4096

// write moves GPU triples into the peer engine's GPU memory behind l.
func (g *gpuPlane) write(ctx context.Context, p *MemoryPlane, l *memLink, ts []Triple) error {
	pieces := 0
	for _, t := range ts {
		pieces += cuda.Pieces(t.Len)
	}
	return g.move(ctx, p, l, ts, len(ts) > 2*gpuChunk, pieces, func(dev Device, srcs []*gpuRegion, emit func([]cuda.Run) error) ([]*gpuRegion, uint64, error) {
		runs := gpuRuns.Get().(*[]cuda.Run)
		defer gpuRuns.Put(runs)
		var total uint64
		for i := 0; i < len(ts); i += gpuChunk {
			var n uint64
			var err error
			*runs, srcs, n, err = g.resolve(ctx, l, dev, ts[i:min(i+gpuChunk, len(ts))], (*runs)[:0], srcs)
			if err == nil {
				err = emit(*runs)
			}
			if err != nil {
				return srcs, 0, err
			}
			total += n
		}
		return srcs, total, nil
	})
}

// writePages moves a page write of GPU memory (ts: w.mergedTriples()) into
// the peer engine behind l.
func (g *gpuPlane) writePages(ctx context.Context, p *MemoryPlane, l *memLink, w *PageWrite, ts []Triple) error {
	prs := w.runs()
	pieces := 0
	for _, b := range w.Bufs {
		for _, r := range prs {
			pieces += cuda.Pieces(r.count * b.PageLen)
		}
	}
	return g.move(ctx, p, l, ts, len(w.Bufs)*len(prs) > 2*gpuChunk, pieces, func(dev Device, srcs []*gpuRegion, emit func([]cuda.Run) error) ([]*gpuRegion, uint64, error) {
		srcs, err := g.pageRuns(ctx, l, dev, w, prs, srcs, emit)
		return srcs, w.Bytes(), err
	})
}

// move writes ts: by the staged path where route says so, else by copying
// the runs list hands to emit (in parts of at most gpuChunk; list reads
// the sources on dev, read-locking their regions and adding them to srcs,
// as resolve does). A write of few runs goes in one copy, for which the
// copier picks a kernel or a copy per run; a big one (parts) in one kernel
// launch per part (pieces: the descriptors they need), each queued as soon
// as it is listed, so listing the next overlaps copying this one. Resolve
// time counts listing (and queueing); copy time what the GPU still needed
// after.
func (g *gpuPlane) move(ctx context.Context, p *MemoryPlane, l *memLink, ts []Triple, parts bool, pieces int,
	list func(dev Device, srcs []*gpuRegion, emit func([]cuda.Run) error) ([]*gpuRegion, uint64, error)) error {
	dev, staged, err := g.route(ctx, l, ts[0]) // prunes l's stale imports
	if err != nil {
		return err
	}
	if staged {
		return g.writeStaged(ctx, p, l, dev, ts)
	}
	g.pmu.RLock()
	defer g.pmu.RUnlock()
	var srcs []*gpuRegion
	defer func() {
		for _, r := range srcs {
			r.use.RUnlock()
		}
	}()
	all := gpuRuns.Get().(*[]cuda.Run)
	defer gpuRuns.Put(all)
	*all = (*all)[:0]
	emit := func(rs []cuda.Run) error { *all = append(*all, rs...); return nil }
	var b CopyBatch
	if parts = parts && gpuCopyMode != cuda.CopyMemcpy; parts {
		if b, err = dev.Begin(pieces); err != nil {
			return fmt.Errorf("GPU copy: %w", err)
		}
		emit = b.Add
	}
	start := time.Now()
	var total uint64
	srcs, total, err = list(dev, srcs, emit)
	if err == nil {
		err = ctx.Err()
	}
	listed := time.Now()
	p.m.gpuResolve.Add(listed.Sub(start).Seconds())
	var cerr error
	if parts {
		cerr = b.Wait() // also after an error: nothing may be in flight on return
	} else if err == nil {
		cerr = dev.Copy(*all, gpuCopyMode)
	}
	p.m.gpuCopy.Add(time.Since(listed).Seconds())
	if err != nil {
		return err
	}
	if cerr != nil {
		return fmt.Errorf("GPU copy: %w", cerr)
	}
	p.m.written.Add(float64(total))
	return nil
}

// gpuRuns recycles run lists: a big write has 10^5 runs, and allocating
// them per write keeps the collector busy.
var gpuRuns = sync.Pool{New: func() any { return new([]cuda.Run) }}

// resolve appends ts as device-address runs to runs, merging runs
// contiguous on both sides. Source regions not yet in srcs are read-locked
// and appended (also on error); the caller unlocks them. Call with pmu
// read-held.
func (g *gpuPlane) resolve(ctx context.Context, l *memLink, dev Device, ts []Triple, runs []cuda.Run, srcs []*gpuRegion) ([]cuda.Run, []*gpuRegion, uint64, error) {
	var total uint64
	refreshed := false
	// SGLang's triples walk one buffer's pages at a time: the last source
	// and destination regions usually hold the next triple too.
	var src *gpuRegion
	var dst wire.MemRegion
	var dptr uint64
	for i, t := range ts {
		if t.Len == 0 {
			continue
		}
		var err error
		if src, srcs, err = g.sourceOf(t, src, dev, srcs); err != nil {
			return nil, srcs, 0, fmt.Errorf("triple %d: %w", i, err)
		}
		if dptr == 0 || t.Dst < dst.Base || t.Dst+t.Len > dst.Base+dst.Len {
			if dst, dptr, err = g.destination(ctx, l, src.dev, t.Dst, t.Len, &refreshed); err != nil {
				return nil, srcs, 0, fmt.Errorf("triple %d: %w", i, err)
			}
		}
		s, d := src.ptr+(t.Src-src.base), dptr+(t.Dst-dst.Base)
		total += t.Len
		if n := len(runs); n > 0 && runs[n-1].Src+runs[n-1].Len == s && runs[n-1].Dst+runs[n-1].Len == d {
			runs[n-1].Len += t.Len
			continue
		}
		runs = append(runs, cuda.Run{Src: s, Dst: d, Len: t.Len})
	}
	return runs, srcs, total, nil
}

// sourceOf returns the source region of triple t: last, the previous
// triple's, when it holds t too (SGLang's triples walk one buffer's pages
// at a time), else one found by source.
func (g *gpuPlane) sourceOf(t Triple, last *gpuRegion, dev Device, srcs []*gpuRegion) (*gpuRegion, []*gpuRegion, error) {
	if t.Src+t.Len < t.Src || t.Dst+t.Len < t.Dst {
		return nil, srcs, errors.New("range wraps")
	}
	if last != nil && t.Src >= last.base && t.Src+t.Len <= last.end() {
		return last, srcs, nil
	}
	return g.source(t.Src, t.Len, dev, srcs)
}

// source returns the registered region holding [addr, addr+n),
// read-locking it and adding it to srcs if it is not there yet.
func (g *gpuPlane) source(addr, n uint64, dev Device, srcs []*gpuRegion) (*gpuRegion, []*gpuRegion, error) {
	src := g.find(addr, n)
	if src == nil {
		return nil, srcs, fmt.Errorf("source [%#x,+%d): %w here (a write moves GPU or host memory, not both)", addr, n, ErrNotRegistered)
	}
	if src.dev != dev {
		return nil, srcs, fmt.Errorf("source [%#x,+%d) is on GPU %d, the write's first source on GPU %d: one write reads one device", addr, n, src.dev.Ordinal(), dev.Ordinal())
	}
	if !slices.Contains(srcs, src) {
		src.use.RLock()
		srcs = append(srcs, src)
		if src.gone {
			return nil, srcs, fmt.Errorf("source [%#x,+%d): %w here", addr, n, ErrNotRegistered)
		}
	}
	return src, srcs, nil
}

// destination returns the peer GPU region holding [addr, addr+n) and where
// it is mapped in dev's context (errStaged if dev cannot reach it).
func (g *gpuPlane) destination(ctx context.Context, l *memLink, dev Device, addr, n uint64, refreshed *bool) (wire.MemRegion, uint64, error) {
	dst, err := l.lookup(ctx, addr, n, refreshed)
	if err != nil {
		return dst, 0, err
	}
	ptr, err := g.peerPtr(l, dst, dev)
	return dst, ptr, err
}

// lookup returns the peer region holding [addr, addr+n), refreshing the
// peer's table once per write (*refreshed) if it names no such region.
func (l *memLink) lookup(ctx context.Context, addr, n uint64, refreshed *bool) (wire.MemRegion, error) {
	dst, ok := l.remoteRegion(addr, n)
	if !ok && !*refreshed {
		*refreshed = true
		if err := l.refresh(ctx); err != nil {
			return dst, fmt.Errorf("refresh peer regions: %w", err)
		}
		dst, ok = l.remoteRegion(addr, n)
	}
	if !ok {
		return dst, fmt.Errorf("destination [%#x,+%d): %w at the peer", addr, n, ErrNotRegistered)
	}
	return dst, nil
}

// pageRuns resolves each buffer of w once and lists its device-address
// runs (prs: w.runs()), buffer by buffer; emit takes them in parts of at most gpuChunk (it
// may keep the slice until it returns). Source regions are read-locked and
// added to srcs as in resolve. Call with pmu read-held.
func (g *gpuPlane) pageRuns(ctx context.Context, l *memLink, dev Device, w *PageWrite, prs []pageRun, srcs []*gpuRegion, emit func([]cuda.Run) error) ([]*gpuRegion, error) {
	srcLo, srcHi, dstLo, dstHi := w.span()
	refreshed := false
	runs := gpuRuns.Get().(*[]cuda.Run)
	defer gpuRuns.Put(runs)
	out := (*runs)[:0]
	for i, b := range w.Bufs {
		// The buffer's lowest to highest page on each side lies in one region.
		sa, da := b.Src+srcLo*b.PageLen, b.Dst+dstLo*b.PageLen
		src, s, err := g.source(sa, (srcHi-srcLo)*b.PageLen, dev, srcs)
		if srcs = s; err != nil {
			return srcs, fmt.Errorf("buffer %d: %w", i, err)
		}
		dst, dptr, err := g.destination(ctx, l, src.dev, da, (dstHi-dstLo)*b.PageLen, &refreshed)
		if err != nil {
			return srcs, fmt.Errorf("buffer %d: %w", i, err)
		}
		sp, dp := src.ptr+(b.Src-src.base), dptr+(b.Dst-dst.Base) // page 0's addresses, maybe outside the regions
		for _, r := range prs {
			out = append(out, cuda.Run{Src: sp + r.src*b.PageLen, Dst: dp + r.dst*b.PageLen, Len: r.count * b.PageLen})
			if len(out) == gpuChunk {
				if err := emit(out); err != nil {
					return srcs, err
				}
				out = out[:0]
			}
		}
	}
	*runs = out
	if len(out) == 0 {
		return srcs, nil
	}
	return srcs, emit(out)
}
