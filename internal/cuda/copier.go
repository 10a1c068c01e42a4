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

// copyPiece splits runs for the kernel, so a few long runs still spread
// over every multiprocessor.
const copyPiece = 64 << 10

// Copier moves batches of device-to-device runs on its own stream, in one
// kernel launch per batch (or one cuMemcpyDtoDAsync per run), and waits
// for them. Safe for concurrent use; batches run one at a time.
type Copier struct {
	d  *Device
	mu sync.Mutex
	// stream, module and fn are driver handles: C memory, never Go's.
	stream, module, fn unsafe.Pointer
	desc               uint64 // device buffer of descCap triples
	descCap            int
	host               []uint64
	closed             bool
}

// NewCopier creates a stream and loads the copy kernel (JIT from PTX).
func (d *Device) NewCopier() (*Copier, error) {
	c := &Copier{d: d}
	ptx := C.CString(copyPTX)
	defer C.free(unsafe.Pointer(ptx))
	if err := result("cuModuleLoadData(copy.ptx)", C.cudag_copier_create(d.ctx, ptx, &c.stream, &c.module, &c.fn)); err != nil {
		return nil, err
	}
	return c, nil
}

// Copy moves every run and returns once all bytes are in place. Mode picks
// kernel or per-run copies; CopyAuto uses copies for a handful of runs and
// the kernel otherwise.
func (c *Copier) Copy(runs []Run, mode CopyMode) (CopyMode, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return mode, errors.New("cuda: copier closed")
	}
	if len(runs) == 0 {
		return mode, nil
	}
	if mode == CopyAuto {
		mode = CopyKernel
		if len(runs) <= memcpyRuns {
			mode = CopyMemcpy
		}
	}
	c.host = c.host[:0]
	for _, r := range runs {
		if mode == CopyMemcpy {
			c.host = append(c.host, r.Src, r.Dst, r.Len)
			continue
		}
		for off := uint64(0); off < r.Len; off += copyPiece {
			c.host = append(c.host, r.Src+off, r.Dst+off, min(copyPiece, r.Len-off))
		}
	}
	n := len(c.host) / 3
	kernel := C.int(0)
	grid := min(n, maxGrid)
	if mode == CopyKernel {
		kernel = 1
		if err := c.reserve(n); err != nil {
			return mode, err
		}
	}
	err := result("copy runs", C.cudag_copy_runs(c.d.ctx, c.stream, c.fn, C.uint64_t(c.desc),
		(*C.uint64_t)(unsafe.Pointer(&c.host[0])), C.uint(n), kernel, C.uint(grid), 256))
	return mode, err
}

// reserve grows the device descriptor buffer to n triples.
func (c *Copier) reserve(n int) error {
	if n <= c.descCap {
		return nil
	}
	if c.desc != 0 {
		if err := c.d.Free(c.desc); err != nil {
			return err
		}
		c.desc, c.descCap = 0, 0
	}
	p, err := c.d.Alloc(n * 24)
	if err != nil {
		return err
	}
	c.desc, c.descCap = p, n
	return nil
}

// Close frees the stream, kernel and descriptor buffer.
func (c *Copier) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil
	}
	c.closed = true
	var err error
	if c.desc != 0 {
		err = c.d.Free(c.desc)
	}
	C.cudag_copier_destroy(c.d.ctx, c.stream, c.module)
	return err
}
