//go:build cgo

package cuda

/*
#include <stdlib.h>
#include "driver.h"
*/
import "C"

import (
	_ "embed"
	"errors"
	"sync"
	"unsafe"
)

//go:embed copy.ptx
var copyPTX string

// Copier moves batches of device-to-device runs on its own streams, in one
// kernel launch per batch (or one cuMemcpyDtoDAsync per run, spread over
// the streams), and waits for them. Safe for concurrent use; batches run
// one at a time.
type Copier struct {
	d  *Device
	mu sync.Mutex
	// streams, module and fn are driver handles: C memory, never Go's.
	// The kernel runs on streams[0].
	streams    [copyStreams]unsafe.Pointer
	module, fn unsafe.Pointer
	desc       uint64 // device buffer of descCap triples
	descCap    int
	// pinned is page-locked host memory for descCap triples, so the
	// descriptors go up asynchronously instead of through the driver's
	// staging of pageable memory.
	pinned unsafe.Pointer
	list   []uint64 // memcpy batches' runs
	closed bool
}

// NewCopier creates a stream and loads the copy kernel (JIT from PTX).
func (d *Device) NewCopier() (*Copier, error) {
	c := &Copier{d: d}
	ptx := C.CString(copyPTX)
	defer C.free(unsafe.Pointer(ptx))
	if err := result("cuModuleLoadData(copy.ptx)", C.cudag_copier_create(d.ctx, ptx, &c.streams[0], copyStreams, &c.module, &c.fn)); err != nil {
		return nil, err
	}
	return c, nil
}

// Copy moves every run and returns once all bytes are in place. Mode picks
// kernel or per-run copies; CopyAuto uses copies for a handful of runs or
// long ones (the driver's copies move those fastest) and the kernel otherwise.
func (c *Copier) Copy(runs []Run, mode CopyMode) (CopyMode, error) {
	return c.copy(runs, mode, false)
}

// CopyHost is Copy for runs whose source or destination may be pinned host
// memory (AllocHost's): the kernel reaches it through unified addressing,
// per-run copies go by cuMemcpyAsync.
func (c *Copier) CopyHost(runs []Run, mode CopyMode) (CopyMode, error) {
	return c.copy(runs, mode, true)
}

func (c *Copier) copy(runs []Run, mode CopyMode, host bool) (CopyMode, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return mode, errors.New("cuda: copier closed")
	}
	if len(runs) == 0 {
		return mode, nil
	}
	if mode == CopyAuto {
		var total uint64
		for _, r := range runs {
			total += r.Len
		}
		mode = CopyKernel
		if len(runs) <= memcpyRuns || total/uint64(len(runs)) >= memcpyRunLen {
			mode = CopyMemcpy
		}
	}
	buf := c.list[:0]
	if mode == CopyKernel {
		if err := c.reserve(pieces(runs)); err != nil {
			return mode, err
		}
		buf = unsafe.Slice((*uint64)(c.pinned), 3*c.descCap)[:0] // big enough: never reallocates
	}
	for _, r := range runs {
		if mode == CopyMemcpy {
			buf = append(buf, r.Src, r.Dst, r.Len)
			continue
		}
		for off := uint64(0); off < r.Len; off += copyPiece {
			buf = append(buf, r.Src+off, r.Dst+off, min(copyPiece, r.Len-off))
		}
	}
	if mode == CopyMemcpy {
		c.list = buf
	}
	n := len(buf) / 3
	runsPtr := (*C.uint64_t)(unsafe.Pointer(&buf[0]))
	if mode == CopyMemcpy {
		return mode, result("copy runs", C.cudag_memcpy_runs(c.d.ctx, &c.streams[0], copyStreams, runsPtr, C.uint(n), C.int(btoi(host))))
	}
	return mode, result("copy runs", C.cudag_copy_runs(c.d.ctx, c.streams[0], c.fn, C.uint64_t(c.desc), runsPtr, C.uint(n), C.uint(min(n, maxGrid)), 256, 0))
}

// Batch is a kernel copy in parts: each Add puts its runs on the GPU at
// once, so the caller prepares the next part while the GPU moves this one.
// It holds the copier until Wait.
type Batch struct {
	c    *Copier
	used int // descriptors queued
	err  error
}

// Begin starts a batch of at most maxPieces kernel descriptors (see Pieces).
func (c *Copier) Begin(maxPieces int) (*Batch, error) {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil, errors.New("cuda: copier closed")
	}
	if err := c.reserve(max(maxPieces, 1)); err != nil {
		c.mu.Unlock()
		return nil, err
	}
	return &Batch{c: c}, nil
}

// Add queues runs behind the batch's earlier parts.
func (b *Batch) Add(runs []Run) error {
	c := b.c
	if b.err != nil || len(runs) == 0 {
		return b.err
	}
	if b.used+pieces(runs) > c.descCap {
		b.err = errors.New("cuda: batch holds more runs than Begin reserved")
		return b.err
	}
	// Each part has its own slice of the descriptor buffers: earlier ones
	// may still be in flight.
	buf := unsafe.Slice((*uint64)(c.pinned), 3*c.descCap)[3*b.used : 3*b.used]
	for _, r := range runs {
		for off := uint64(0); off < r.Len; off += copyPiece {
			buf = append(buf, r.Src+off, r.Dst+off, min(copyPiece, r.Len-off))
		}
	}
	n := len(buf) / 3
	b.err = result("copy runs", C.cudag_copy_runs(c.d.ctx, c.streams[0], c.fn, C.uint64_t(c.desc+uint64(24*b.used)),
		(*C.uint64_t)(unsafe.Pointer(&buf[0])), C.uint(n), C.uint(min(n, maxGrid)), 256, 1))
	b.used += n
	return b.err
}

// Wait returns once every part is in place (or the first error) and
// releases the copier.
func (b *Batch) Wait() error {
	defer b.c.mu.Unlock()
	return errors.Join(b.err, result("cuStreamSynchronize", C.cudag_stream_wait(b.c.d.ctx, b.c.streams[0])))
}

// pieces counts the kernel's descriptors for runs.
func pieces(runs []Run) int {
	n := 0
	for _, r := range runs {
		n += Pieces(r.Len)
	}
	return n
}

// reserve grows the device and pinned descriptor buffers to n triples
// (doubling, so a growing workload reallocates rarely).
func (c *Copier) reserve(n int) error {
	if n <= c.descCap {
		return nil
	}
	n = max(n, 2*c.descCap)
	if err := c.freeDesc(); err != nil {
		return err
	}
	p, err := c.d.Alloc(n * 24)
	if err != nil {
		return err
	}
	var h unsafe.Pointer
	if err := result("cuMemAllocHost", C.cudag_mem_alloc_host(c.d.ctx, C.size_t(n*24), &h)); err != nil {
		return errors.Join(err, c.d.Free(p))
	}
	c.desc, c.descCap, c.pinned = p, n, h
	return nil
}

func (c *Copier) freeDesc() error {
	var err error
	if c.desc != 0 {
		err = c.d.Free(c.desc)
	}
	if c.pinned != nil {
		err = errors.Join(err, result("cuMemFreeHost", C.cudag_mem_free_host(c.d.ctx, c.pinned)))
	}
	c.desc, c.descCap, c.pinned = 0, 0, nil
	return err
}

// Close frees the stream, kernel and descriptor buffer.
func (c *Copier) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil
	}
	c.closed = true
	err := c.freeDesc()
	C.cudag_copier_destroy(c.d.ctx, &c.streams[0], copyStreams, c.module)
	return err
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}
