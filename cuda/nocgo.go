//go:build !cgo

package cuda

import "fmt"

// Without cgo there is no driver to load: everything reports ErrNoDriver.
var errNoCgo = fmt.Errorf("%w: built without cgo", ErrNoDriver)

// Load returns ErrNoDriver.
func Load() error { return errNoCgo }

// DeviceCount returns ErrNoDriver.
func DeviceCount() (int, error) { return 0, errNoCgo }

// Device is unavailable without cgo.
type Device struct{}

// Open returns ErrNoDriver.
func Open(int) (*Device, error) { return nil, errNoCgo }

// Ordinal returns -1.
func (*Device) Ordinal() int { return -1 }

// Close returns nil.
func (*Device) Close() error { return nil }

// MakeCurrent returns ErrNoDriver.
func (*Device) MakeCurrent() error { return errNoCgo }

// OpenIPC returns ErrNoDriver.
func (*Device) OpenIPC(Handle) (uint64, error) { return 0, errNoCgo }

// CloseIPC returns ErrNoDriver.
func (*Device) CloseIPC(uint64) error { return errNoCgo }

// IPCHandle returns ErrNoDriver.
func (*Device) IPCHandle(uint64) (Handle, error) { return Handle{}, errNoCgo }

// Alloc returns ErrNoDriver.
func (*Device) Alloc(int) (uint64, error) { return 0, errNoCgo }

// Free returns ErrNoDriver.
func (*Device) Free(uint64) error { return errNoCgo }

// CopyFromHost returns ErrNoDriver.
func (*Device) CopyFromHost(uint64, []byte) error { return errNoCgo }

// CopyToHost returns ErrNoDriver.
func (*Device) CopyToHost([]byte, uint64) error { return errNoCgo }

// Memset returns ErrNoDriver.
func (*Device) Memset(uint64, byte, int) error { return errNoCgo }

// AddressRange returns ErrNoDriver.
func (*Device) AddressRange(uint64) (uint64, int, error) { return 0, 0, errNoCgo }

// AllocHost returns ErrNoDriver.
func (*Device) AllocHost(int) ([]byte, error) { return nil, errNoCgo }

// FreeHost returns ErrNoDriver.
func (*Device) FreeHost([]byte) error { return errNoCgo }

// CanAccessPeer returns ErrNoDriver.
func CanAccessPeer(int, int) (bool, error) { return false, errNoCgo }

// Kind returns ErrNoDriver.
func Kind(uint64) (PointerKind, int, error) { return 0, -1, errNoCgo }

// With returns ErrNoDriver.
func (*Device) With(func() error) error { return errNoCgo }

// Copier is unavailable without cgo.
type Copier struct{}

// NewCopier returns ErrNoDriver.
func (*Device) NewCopier() (*Copier, error) { return nil, errNoCgo }

// Copy returns ErrNoDriver.
func (*Copier) Copy([]Run, CopyMode) (CopyMode, error) { return 0, errNoCgo }

// CopyHost returns ErrNoDriver.
func (*Copier) CopyHost([]Run, CopyMode) (CopyMode, error) { return 0, errNoCgo }

// Close returns nil.
func (*Copier) Close() error { return nil }

// Batch is unavailable without cgo.
type Batch struct{}

// Begin returns ErrNoDriver.
func (*Copier) Begin(int) (*Batch, error) { return nil, errNoCgo }

// Add returns ErrNoDriver.
func (*Batch) Add([]Run) error { return errNoCgo }

// Wait returns ErrNoDriver.
func (*Batch) Wait() error { return errNoCgo }
