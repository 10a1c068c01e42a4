//go:build cgo

package cuda

/*
#cgo LDFLAGS: -ldl
#include <stdlib.h>
#include "driver.h"
*/
import "C"

import (
	"fmt"
	"os"
	"runtime"
	"sync"
	"unsafe"
)

// DefaultLibrary is the driver library's soname; PDROUTER_LIBCUDA overrides it.
const DefaultLibrary = "libcuda.so.1"

var load struct {
	once sync.Once
	err  error
}

// Load opens the driver once per process and reports whether it is usable.
func Load() error {
	load.once.Do(func() {
		path := os.Getenv("PDROUTER_LIBCUDA")
		if path == "" {
			path = DefaultLibrary
		}
		load.err = loadFrom(path)
	})
	return load.err
}

// loadFrom opens the driver library at path and runs cuInit.
func loadFrom(path string) error {
	cpath := C.CString(path)
	defer C.free(unsafe.Pointer(cpath))
	var msg [512]C.char
	if C.cudag_load(cpath, &msg[0], C.size_t(len(msg))) != 0 {
		return fmt.Errorf("%w: %s", ErrNoDriver, C.GoString(&msg[0]))
	}
	if err := result("cuInit", C.cudag_init()); err != nil {
		return fmt.Errorf("%w: %v", ErrNoDriver, err)
	}
	return nil
}

func result(op string, r C.int) error {
	if r == 0 {
		return nil
	}
	return &Error{Op: op, Code: int(r), Text: C.GoString(C.cudag_error_string(r))}
}

// DeviceCount is the number of CUDA devices.
func DeviceCount() (int, error) {
	if err := Load(); err != nil {
		return 0, err
	}
	var n C.int
	err := result("cuDeviceGetCount", C.cudag_device_count(&n))
	return int(n), err
}

// Device is one GPU's primary context, retained until Close.
type Device struct {
	ordinal int
	ctx     unsafe.Pointer
	mu      sync.Mutex
	closed  bool
}

// Open retains the primary context of the device with this ordinal.
func Open(ordinal int) (*Device, error) {
	if err := Load(); err != nil {
		return nil, err
	}
	d := &Device{ordinal: ordinal}
	if err := result("cuDevicePrimaryCtxRetain", C.cudag_ctx_retain(C.int(ordinal), &d.ctx)); err != nil {
		return nil, err
	}
	return d, nil
}

// Ordinal is the device's number.
func (d *Device) Ordinal() int { return d.ordinal }

// Close releases the primary context. Memory opened or allocated through
// the device must be closed or freed first.
func (d *Device) Close() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil
	}
	d.closed = true
	return result("cuDevicePrimaryCtxRelease", C.cudag_ctx_release(C.int(d.ordinal)))
}

// MakeCurrent makes the device's context current on the calling OS thread;
// call it from a goroutine locked to its thread.
func (d *Device) MakeCurrent() error {
	return result("cuCtxSetCurrent", C.cudag_ctx_set_current(d.ctx))
}

// OpenIPC maps another process's allocation by its IPC handle and returns
// the mapping's base address in this process. A process cannot open its
// own handles (the driver refuses).
func (d *Device) OpenIPC(h Handle) (uint64, error) {
	var ptr C.uint64_t
	ch := (*C.cudag_ipc_handle_t)(unsafe.Pointer(&h))
	if err := result("cuIpcOpenMemHandle", C.cudag_ipc_open(d.ctx, ch, &ptr)); err != nil {
		return 0, err
	}
	return uint64(ptr), nil
}

// CloseIPC unmaps what OpenIPC returned.
func (d *Device) CloseIPC(ptr uint64) error {
	return result("cuIpcCloseMemHandle", C.cudag_ipc_close(d.ctx, C.uint64_t(ptr)))
}

// IPCHandle returns the IPC handle of the allocation whose base is ptr.
func (d *Device) IPCHandle(ptr uint64) (Handle, error) {
	var h Handle
	err := result("cuIpcGetMemHandle", C.cudag_ipc_get(d.ctx, C.uint64_t(ptr), (*C.cudag_ipc_handle_t)(unsafe.Pointer(&h))))
	return h, err
}

// Alloc allocates n bytes of device memory (cuMemAlloc).
func (d *Device) Alloc(n int) (uint64, error) {
	if n <= 0 {
		return 0, fmt.Errorf("cuda: alloc: bad length %d", n)
	}
	var ptr C.uint64_t
	err := result("cuMemAlloc", C.cudag_mem_alloc(d.ctx, C.size_t(n), &ptr))
	return uint64(ptr), err
}

// Free frees what Alloc returned.
func (d *Device) Free(ptr uint64) error {
	return result("cuMemFree", C.cudag_mem_free(d.ctx, C.uint64_t(ptr)))
}

// CopyFromHost copies src to device address dst (synchronous).
func (d *Device) CopyFromHost(dst uint64, src []byte) error {
	if len(src) == 0 {
		return nil
	}
	return result("cuMemcpyHtoD", C.cudag_memcpy_htod(d.ctx, C.uint64_t(dst), unsafe.Pointer(&src[0]), C.size_t(len(src))))
}

// CopyToHost copies len(dst) bytes from device address src (synchronous).
func (d *Device) CopyToHost(dst []byte, src uint64) error {
	if len(dst) == 0 {
		return nil
	}
	return result("cuMemcpyDtoH", C.cudag_memcpy_dtoh(d.ctx, unsafe.Pointer(&dst[0]), C.uint64_t(src), C.size_t(len(dst))))
}

// Memset sets n bytes at dst to v.
func (d *Device) Memset(dst uint64, v byte, n int) error {
	return result("cuMemsetD8", C.cudag_memset8(d.ctx, C.uint64_t(dst), C.uchar(v), C.size_t(n)))
}

// AddressRange returns the base and size of the allocation holding ptr.
func (d *Device) AddressRange(ptr uint64) (base uint64, size int, err error) {
	var b C.uint64_t
	var n C.size_t
	err = result("cuMemGetAddressRange", C.cudag_address_range(d.ctx, C.uint64_t(ptr), &b, &n))
	return uint64(b), int(n), err
}

// AllocHost allocates n bytes of page-locked host memory the device copies
// to and from at full speed (cuMemAllocHost); free it with FreeHost.
func (d *Device) AllocHost(n int) ([]byte, error) {
	if n <= 0 {
		return nil, fmt.Errorf("cuda: alloc host: bad length %d", n)
	}
	var p unsafe.Pointer
	if err := result("cuMemAllocHost", C.cudag_mem_alloc_host(d.ctx, C.size_t(n), &p)); err != nil {
		return nil, err
	}
	return unsafe.Slice((*byte)(p), n), nil
}

// FreeHost frees what AllocHost returned.
func (d *Device) FreeHost(b []byte) error {
	if len(b) == 0 {
		return nil
	}
	return result("cuMemFreeHost", C.cudag_mem_free_host(d.ctx, unsafe.Pointer(unsafe.SliceData(b))))
}

// CanAccessPeer reports whether device a can map device b's memory
// (cuDeviceCanAccessPeer); a device reaches its own.
func CanAccessPeer(a, b int) (bool, error) {
	if a == b {
		return true, nil
	}
	if err := Load(); err != nil {
		return false, err
	}
	var ok C.int
	err := result("cuDeviceCanAccessPeer", C.cudag_can_access_peer(C.int(a), C.int(b), &ok))
	return ok != 0, err
}

// Kind reports what memory ptr points to, and the device ordinal of
// device memory (-1 otherwise).
func Kind(ptr uint64) (PointerKind, int, error) {
	if err := Load(); err != nil {
		return 0, -1, err
	}
	var k, o C.int
	if err := result("cuPointerGetAttribute", C.cudag_pointer_kind(C.uint64_t(ptr), &k, &o)); err != nil {
		return 0, -1, err
	}
	return PointerKind(k), int(o), nil
}

// With runs fn on a locked OS thread with the device's context current, for
// calls into libraries (UCX) that use the calling thread's CUDA context.
func (d *Device) With(fn func() error) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := result("cuCtxPushCurrent", C.cudag_ctx_push(d.ctx)); err != nil {
		return err
	}
	defer C.cudag_ctx_pop()
	return fn()
}
