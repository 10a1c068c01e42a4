//go:build !cgo

package ucx

import "time"

// The same API without cgo: constructors fail with ErrUnavailable, so no
// method below is reachable with a live object.

// LiveObjects reports zero: nothing can be created without cgo.
func LiveObjects() Live { return Live{} }

// Context is unavailable without cgo.
type Context struct{}

// NewContext returns ErrUnavailable.
func NewContext(Config) (*Context, error) { return nil, ErrUnavailable }

// Close returns ErrUnavailable.
func (*Context) Close() error { return ErrUnavailable }

// Alloc returns ErrUnavailable.
func (*Context) Alloc(int) (*Memory, error) { return nil, ErrUnavailable }

// Map returns ErrUnavailable.
func (*Context) Map([]byte) (*Memory, error) { return nil, ErrUnavailable }

// MapAddr returns ErrUnavailable.
func (*Context) MapAddr(uintptr, int, MemoryType) (*Memory, error) { return nil, ErrUnavailable }

// Supports returns false.
func (*Context) Supports(MemoryType) bool { return false }

// APIVersion returns "" : no UCX is compiled in.
func APIVersion() string { return "" }

// NewWorker returns ErrUnavailable.
func (*Context) NewWorker(ThreadMode) (*Worker, error) { return nil, ErrUnavailable }

// Memory is unavailable without cgo.
type Memory struct{}

// Bytes returns nil.
func (*Memory) Bytes() []byte { return nil }

// Addr returns 0.
func (*Memory) Addr() uint64 { return 0 }

// Len returns 0.
func (*Memory) Len() int { return 0 }

// Type returns MemoryHost.
func (*Memory) Type() MemoryType { return MemoryHost }

// PackRkey returns ErrUnavailable.
func (*Memory) PackRkey() ([]byte, error) { return nil, ErrUnavailable }

// Close returns ErrUnavailable.
func (*Memory) Close() error { return ErrUnavailable }

// Worker is unavailable without cgo.
type Worker struct{}

// Progress returns false.
func (*Worker) Progress() bool { return false }

// Address returns ErrUnavailable.
func (*Worker) Address() ([]byte, error) { return nil, ErrUnavailable }

// EventFD returns -1.
func (*Worker) EventFD() int { return -1 }

// Arm returns ErrUnavailable.
func (*Worker) Arm() (bool, error) { return false, ErrUnavailable }

// WaitEvents returns ErrUnavailable.
func (*Worker) WaitEvents(time.Duration) error { return ErrUnavailable }

// Signal returns ErrUnavailable.
func (*Worker) Signal() error { return ErrUnavailable }

// Flush returns ErrUnavailable.
func (*Worker) Flush() (*Request, error) { return nil, ErrUnavailable }

// SetAMHandler returns ErrUnavailable.
func (*Worker) SetAMHandler(uint16, AMHandler) error { return ErrUnavailable }

// Close returns ErrUnavailable.
func (*Worker) Close() error { return ErrUnavailable }

// Listen returns ErrUnavailable.
func (*Worker) Listen(string) (*Listener, error) { return nil, ErrUnavailable }

// Connect returns ErrUnavailable.
func (*Worker) Connect(string, time.Duration) (*Endpoint, error) { return nil, ErrUnavailable }

// ConnectAddress returns ErrUnavailable.
func (*Worker) ConnectAddress([]byte) (*Endpoint, error) { return nil, ErrUnavailable }

// Listener is unavailable without cgo.
type Listener struct{}

// Addr returns "".
func (*Listener) Addr() string { return "" }

// Accept returns ErrUnavailable.
func (*Listener) Accept(time.Duration) (*Endpoint, error) { return nil, ErrUnavailable }

// Close does nothing.
func (*Listener) Close() {}

// Endpoint is unavailable without cgo.
type Endpoint struct{}

// Err returns ErrUnavailable.
func (*Endpoint) Err() error { return ErrUnavailable }

// UnpackRkey returns ErrUnavailable.
func (*Endpoint) UnpackRkey([]byte) (*Rkey, error) { return nil, ErrUnavailable }

// Put returns ErrUnavailable.
func (*Endpoint) Put(*Memory, uint64, *Rkey, uint64, uint64) (*Request, error) {
	return nil, ErrUnavailable
}

// Get returns ErrUnavailable.
func (*Endpoint) Get(*Memory, uint64, *Rkey, uint64, uint64) (*Request, error) {
	return nil, ErrUnavailable
}

// PutBatch returns ErrUnavailable.
func (*Endpoint) PutBatch(*Memory, *Rkey, uint64, []Op) (*Request, error) {
	return nil, ErrUnavailable
}

// GetBatch returns ErrUnavailable.
func (*Endpoint) GetBatch(*Memory, *Rkey, uint64, []Op) (*Request, error) {
	return nil, ErrUnavailable
}

// Flush returns ErrUnavailable.
func (*Endpoint) Flush() (*Request, error) { return nil, ErrUnavailable }

// SendAM returns ErrUnavailable.
func (*Endpoint) SendAM(uint16, []byte, []byte) (*Request, error) { return nil, ErrUnavailable }

// Close returns ErrUnavailable.
func (*Endpoint) Close() error { return ErrUnavailable }

// Info returns ErrUnavailable.
func (*Endpoint) Info() (string, error) { return "", ErrUnavailable }

// Rkey is unavailable without cgo.
type Rkey struct{}

// Close does nothing.
func (*Rkey) Close() {}

// Request is unavailable without cgo.
type Request struct{}

// Test returns ErrUnavailable.
func (*Request) Test() (bool, error) { return false, ErrUnavailable }

// Wait returns ErrUnavailable.
func (*Request) Wait(time.Duration) error { return ErrUnavailable }

// Cancel does nothing.
func (*Request) Cancel() {}

// Free does nothing.
func (*Request) Free() {}

// Loop is unavailable without cgo.
type Loop struct{}

// NewLoop returns ErrUnavailable.
func NewLoop(*Context, LoopConfig) (*Loop, error) { return nil, ErrUnavailable }

// Submit returns ErrUnavailable.
func (*Loop) Submit(func(*Worker)) error { return ErrUnavailable }

// Do returns ErrUnavailable.
func (*Loop) Do(func(*Worker) error) error { return ErrUnavailable }

// Close returns ErrUnavailable.
func (*Loop) Close() error { return ErrUnavailable }

// Done returns nil: there is no loop to stop.
func (*Loop) Done() <-chan struct{} { return nil }

// Err returns ErrUnavailable.
func (*Loop) Err() error { return ErrUnavailable }
