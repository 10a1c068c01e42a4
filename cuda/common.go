package cuda

import (
	"errors"
	"fmt"
)

// ErrNoDriver means no usable CUDA driver was found (no libcuda.so.1, no
// device, or a build without cgo).
var ErrNoDriver = errors.New("cuda: no CUDA driver")

// HandleSize is the size of a CUDA IPC memory handle (cudaIpcMemHandle_t).
const HandleSize = 64

// Handle is a CUDA IPC memory handle of an allocation's base.
type Handle [HandleSize]byte

// Error is a failed driver call with the driver's code and text.
type Error struct {
	Op   string // the driver entry point, e.g. "cuIpcOpenMemHandle"
	Code int    // CUresult
	Text string
}

func (e *Error) Error() string { return fmt.Sprintf("cuda: %s: %s (%d)", e.Op, e.Text, e.Code) }

// PointerKind is what the driver knows of an address.
type PointerKind int

// Pointer kinds (CU_MEMORYTYPE_*, with Host also for memory CUDA never saw).
const (
	PointerHost    PointerKind = 1
	PointerDevice  PointerKind = 2
	PointerUnified PointerKind = 4
)

// Run is one device-to-device copy: Len bytes from Src to Dst, both device
// addresses of this process (its own memory or mappings opened by IPC).
type Run struct{ Src, Dst, Len uint64 }

// CopyMode is how a Copier moves a batch.
type CopyMode int

// Copy modes.
const (
	CopyAuto   CopyMode = iota
	CopyKernel          // one launch of the copy kernel for the whole batch
	CopyMemcpy          // one cuMemcpyDtoDAsync per run
)

func (m CopyMode) String() string {
	switch m {
	case CopyKernel:
		return "kernel"
	case CopyMemcpy:
		return "memcpy"
	}
	return "auto"
}

const (
	// memcpyRuns: up to this many runs CopyAuto issues one copy per run
	// (a launch costs a few µs, so few long runs go faster so).
	memcpyRuns = 8
	// memcpyRunLen: runs this long on average go as copies too.
	memcpyRunLen = 16 << 20
	// maxGrid bounds the kernel's blocks; each loops over its share.
	maxGrid = 4096
	// copyStreams: per-run copies go round robin over this many streams,
	// so the GPU starts the next while one drains (64 copies of 64 MiB
	// on one stream ran at 1,875 GB/s, a single 4 GiB copy at 2,140).
	copyStreams = 4
)

// copyPiece splits runs for the kernel, so a few long runs still spread
// over every multiprocessor.
const copyPiece = 64 << 10

// Pieces is how many kernel descriptors a run of n bytes needs.
func Pieces(n uint64) int { return int((n + copyPiece - 1) / copyPiece) }
