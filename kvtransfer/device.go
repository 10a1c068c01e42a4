package kvtransfer

import (
	"cmp"
	"errors"
	"fmt"
	"unsafe"

	"github.com/pdrouter/pdrouter/cuda"
)

// Span is a range of memory in a Device's address space: a device address
// for a GPU.
type Span struct{ Addr, Len uint64 }

// CopyBatch is a device-to-device copy in parts: each Add is queued at
// once, Wait returns when all of them are done (also after an error, so
// nothing is in flight on return).
type CopyBatch interface {
	Add([]cuda.Run) error
	Wait() error
}

// Device is one GPU as the memory plane uses it, in its own context: it
// opens engines' allocations by IPC handle and copies between, into and
// out of them.
type Device interface {
	// Gather and Scatter move bytes between the device's memory and host
	// staging buffers, the two ends of every staged path: the writer
	// gathers source pages into a staging buffer, the bytes cross the
	// link, the receiver scatters them.
	//
	// Gather copies the spans, in order and back to back, into stage and
	// returns once they are all there. len(stage) >= their total.
	Gather(stage []byte, spans []Span) error
	// Scatter copies stage, back to back, into the spans in order and
	// returns once the bytes are in the device's memory.
	Scatter(spans []Span, stage []byte) error
	// AllocStage returns n bytes of host memory the device copies to and
	// from fastest (pinned for a GPU); FreeStage frees it.
	AllocStage(n int) ([]byte, error)
	FreeStage([]byte) error
	Ordinal() int
	// OpenIPC maps an engine's allocation and returns its base here.
	OpenIPC(cuda.Handle) (uint64, error)
	CloseIPC(ptr uint64) error
	// Locate is the ordinal of the device holding the memory at ptr (a
	// mapping opened here may live on another device).
	Locate(ptr uint64) (int, error)
	// AddressRange is the base and size of the allocation holding ptr.
	AddressRange(ptr uint64) (base uint64, size int, err error)
	// Copy moves device-to-device runs and returns once they are in place.
	Copy(runs []cuda.Run, mode cuda.CopyMode) error
	// Begin starts a batch of at most pieces kernel descriptors (cuda.Pieces).
	Begin(pieces int) (CopyBatch, error)
	Close() error
}

// GPUs opens the devices of this host: the CUDA driver's by default, host
// memory standing in for them in tests.
type GPUs interface {
	Open(ordinal int) (Device, error)
	// PeerAccess reports whether device a can reach device b's memory.
	PeerAccess(a, b int) bool
}

// cudaGPUs is the CUDA driver.
type cudaGPUs struct{}

func (cudaGPUs) Open(ordinal int) (Device, error) {
	d, err := cuda.Open(ordinal)
	if err != nil {
		return nil, err
	}
	cp, err := d.NewCopier()
	if err != nil {
		return nil, errors.Join(err, d.Close())
	}
	return &cudaDevice{Device: d, cp: cp}, nil
}

func (cudaGPUs) PeerAccess(a, b int) bool {
	ok, err := cuda.CanAccessPeer(a, b)
	return err == nil && ok
}

// cudaDevice is a device's primary context and its copier.
type cudaDevice struct {
	*cuda.Device
	cp *cuda.Copier
}

var _ Device = (*cudaDevice)(nil)

func (d *cudaDevice) Copy(runs []cuda.Run, mode cuda.CopyMode) error {
	_, err := d.cp.Copy(runs, mode)
	return err
}

func (d *cudaDevice) Locate(ptr uint64) (int, error) {
	_, ord, err := cuda.Kind(ptr)
	return ord, err
}

func (d *cudaDevice) Begin(pieces int) (CopyBatch, error) { return d.cp.Begin(pieces) }

// stageCopyMode: staging copies go as one cuMemcpy per run, on the copy
// engines; on the H200 the kernel through mapped pinned memory staged every
// other page at 2.96 GB/s against 4.73 (bench/RESULTS.md, issue 28).
var stageCopyMode = cmp.Or(gpuCopyMode, cuda.CopyMemcpy)

func (d *cudaDevice) Gather(stage []byte, spans []Span) error { return d.copyStage(stage, spans, true) }
func (d *cudaDevice) Scatter(spans []Span, stage []byte) error {
	return d.copyStage(stage, spans, false)
}

// copyStage copies between the spans and consecutive ranges of stage, into
// stage or out of it as toStage says.
func (d *cudaDevice) copyStage(stage []byte, spans []Span, toStage bool) error {
	base := uint64(uintptr(unsafe.Pointer(unsafe.SliceData(stage))))
	runs := make([]cuda.Run, 0, len(spans))
	var off uint64
	for _, s := range spans {
		if s.Len > uint64(len(stage))-off {
			return fmt.Errorf("spans of more than the %d-byte staging buffer", len(stage))
		}
		r := cuda.Run{Src: s.Addr, Dst: base + off, Len: s.Len}
		if !toStage {
			r.Src, r.Dst = r.Dst, r.Src
		}
		runs = append(runs, r)
		off += s.Len
	}
	_, err := d.cp.CopyHost(runs, stageCopyMode)
	return err
}

func (d *cudaDevice) AllocStage(n int) ([]byte, error) { return d.AllocHost(n) }
func (d *cudaDevice) FreeStage(b []byte) error         { return d.FreeHost(b) }

func (d *cudaDevice) Close() error { return errors.Join(d.cp.Close(), d.Device.Close()) }
