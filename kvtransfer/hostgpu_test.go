package kvtransfer

import (
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"testing"

	"github.com/pdrouter/pdrouter/cuda"
)

// hostGPUs stands host memory in for the GPUs of one machine: allocations
// are Go memory at made-up device addresses, an IPC handle names one, and
// every plane of the test process sees the same devices. It counts what is
// open, so tests can check nothing leaks.
type hostGPUs struct {
	mu      sync.Mutex
	allocs  []*hostAlloc
	next    uint64
	noPeer  bool // devices cannot reach each other's memory
	noPlace bool // Locate fails, as for a pointer the driver cannot place
	devices int  // open now
	stages  int  // staging buffers not yet freed
	ipc     int  // IPC mappings not yet closed
	opened  int  // IPC mappings opened so far
	// onGather and onScatter, if set, run before each gather or scatter
	// (outside mu) and may fail it.
	onGather, onScatter func(spans []Span) error
	gathers             int    // gathers so far
	maxGather           uint64 // the most bytes one gather moved
}

type hostAlloc struct {
	dev    int
	base   uint64
	mem    []byte
	handle cuda.Handle
}

// newHostGPUs returns stand-in GPUs that, once every plane of the test
// has closed, must have no device, staging buffer or IPC mapping open.
func newHostGPUs(t *testing.T) *hostGPUs {
	h := &hostGPUs{}
	t.Cleanup(func() {
		if d, s, i := h.open(); d != 0 || s != 0 || i != 0 {
			t.Errorf("left open: %d devices, %d staging buffers, %d IPC mappings", d, s, i)
		}
	})
	return h
}

// alloc makes n bytes of "device memory" on device dev.
func (h *hostGPUs) alloc(dev, n int) *hostAlloc {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.next == 0 {
		h.next = 0x7f0000000000
	}
	a := &hostAlloc{dev: dev, base: h.next, mem: make([]byte, n)}
	binary.LittleEndian.PutUint64(a.handle[:], a.base)
	h.next += uint64(n+(1<<20)) &^ (1<<20 - 1)
	h.allocs = append(h.allocs, a)
	return a
}

// slice is the memory at [addr, addr+n); ranges outside every allocation
// fail as a device fault would.
func (h *hostGPUs) slice(addr, n uint64) ([]byte, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, a := range h.allocs {
		if addr >= a.base && addr+n <= a.base+uint64(len(a.mem)) && addr+n >= addr {
			return a.mem[addr-a.base : addr-a.base+n], nil
		}
	}
	return nil, fmt.Errorf("device fault: [%#x,+%d) is no allocation", addr, n)
}

func (h *hostGPUs) Open(ordinal int) (Device, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.devices++
	return &hostDevice{h: h, ordinal: ordinal}, nil
}

func (h *hostGPUs) PeerAccess(a, b int) bool { return a == b || !h.noPeer }

// open reports what is still open: devices, staging buffers, IPC mappings.
func (h *hostGPUs) open() (devices, stages, ipc int) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.devices, h.stages, h.ipc
}

type hostDevice struct {
	h       *hostGPUs
	ordinal int
}

var _ Device = (*hostDevice)(nil)

func (d *hostDevice) Ordinal() int { return d.ordinal }

func (d *hostDevice) OpenIPC(hd cuda.Handle) (uint64, error) {
	d.h.mu.Lock()
	defer d.h.mu.Unlock()
	for _, a := range d.h.allocs {
		if a.handle == hd {
			d.h.ipc++
			d.h.opened++
			return a.base, nil
		}
	}
	return 0, errors.New("invalid IPC handle")
}

func (d *hostDevice) CloseIPC(uint64) error {
	d.h.mu.Lock()
	defer d.h.mu.Unlock()
	d.h.ipc--
	return nil
}

func (d *hostDevice) Locate(ptr uint64) (int, error) {
	d.h.mu.Lock()
	defer d.h.mu.Unlock()
	for _, a := range d.h.allocs {
		if ptr >= a.base && ptr < a.base+uint64(len(a.mem)) && !d.h.noPlace {
			return a.dev, nil
		}
	}
	return -1, errors.New("not an allocation")
}

func (d *hostDevice) AddressRange(ptr uint64) (uint64, int, error) {
	d.h.mu.Lock()
	defer d.h.mu.Unlock()
	for _, a := range d.h.allocs {
		if ptr >= a.base && ptr < a.base+uint64(len(a.mem)) {
			return a.base, len(a.mem), nil
		}
	}
	return 0, 0, errors.New("not an allocation")
}

func (d *hostDevice) Copy(runs []cuda.Run, _ cuda.CopyMode) error {
	for _, r := range runs {
		src, err := d.h.slice(r.Src, r.Len)
		if err != nil {
			return err
		}
		dst, err := d.h.slice(r.Dst, r.Len)
		if err != nil {
			return err
		}
		copy(dst, src)
	}
	return nil
}

type hostBatch struct {
	d   *hostDevice
	err error
}

func (b *hostBatch) Add(runs []cuda.Run) error {
	if b.err == nil {
		b.err = b.d.Copy(runs, cuda.CopyKernel)
	}
	return b.err
}

func (b *hostBatch) Wait() error { return b.err }

func (d *hostDevice) Begin(int) (CopyBatch, error) { return &hostBatch{d: d}, nil }

func (d *hostDevice) Gather(stage []byte, spans []Span) error {
	if d.h.onGather != nil {
		if err := d.h.onGather(spans); err != nil {
			return err
		}
	}
	d.h.mu.Lock()
	d.h.gathers++
	d.h.maxGather = max(d.h.maxGather, spansLen(spans))
	d.h.mu.Unlock()
	var off uint64
	for _, s := range spans {
		src, err := d.h.slice(s.Addr, s.Len)
		if err != nil {
			return err
		}
		if s.Len > uint64(len(stage))-off {
			return errors.New("spans overrun the staging buffer")
		}
		off += uint64(copy(stage[off:], src))
	}
	return nil
}

func spansLen(spans []Span) uint64 {
	var n uint64
	for _, s := range spans {
		n += s.Len
	}
	return n
}

func (d *hostDevice) Scatter(spans []Span, stage []byte) error {
	if d.h.onScatter != nil {
		if err := d.h.onScatter(spans); err != nil {
			return err
		}
	}
	var off uint64
	for _, s := range spans {
		dst, err := d.h.slice(s.Addr, s.Len)
		if err != nil {
			return err
		}
		if s.Len > uint64(len(stage))-off {
			return errors.New("spans overrun the staging buffer")
		}
		off += uint64(copy(dst, stage[off:off+s.Len]))
	}
	return nil
}

func (d *hostDevice) AllocStage(n int) ([]byte, error) {
	d.h.mu.Lock()
	defer d.h.mu.Unlock()
	d.h.stages++
	return make([]byte, n), nil
}

func (d *hostDevice) FreeStage([]byte) error {
	d.h.mu.Lock()
	defer d.h.mu.Unlock()
	d.h.stages--
	return nil
}

func (d *hostDevice) Close() error {
	d.h.mu.Lock()
	defer d.h.mu.Unlock()
	d.h.devices--
	return nil
}
