//go:build !cgo

package ucx

// Abort returns ErrUnavailable.
func (*Endpoint) Abort() error { return ErrUnavailable }
