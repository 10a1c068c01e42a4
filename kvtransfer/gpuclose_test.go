package kvtransfer

import (
	"errors"
	"testing"
	"time"

	"github.com/pdrouter/pdrouter/cuda"
)

// A RegisterCUDA after (or racing) the plane's Close opens no device and
// registers nothing: close has already released what it would release, so
// either would stay for good.
func TestRegisterCUDAAfterCloseOpensNothing(t *testing.T) {
	m := newMemSide(t, "tcp", time.Second)
	if err := m.p.Close(); err != nil {
		t.Fatal(err)
	}
	err := m.s.RegisterCUDA(1<<40, 4096, make([]byte, cuda.HandleSize), 0)
	if !errors.Is(err, ErrClosed) {
		t.Fatalf("register after close: %v, want %v", err, ErrClosed)
	}
	m.p.gpu.mu.Lock()
	opened, regions := m.p.gpu.dev != nil, len(m.p.gpu.regions)
	m.p.gpu.mu.Unlock()
	if opened || regions != 0 {
		t.Fatalf("after close: device opened %v, %d regions", opened, regions)
	}
}
