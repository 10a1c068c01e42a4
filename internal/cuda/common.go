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
