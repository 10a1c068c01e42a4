package kvtransfer

import (
	"bytes"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/pdrouter/pdrouter/internal/cuda"
)

func TestRegisterCUDAChecksArguments(t *testing.T) {
	m := newMemSide(t, "tcp", time.Second)
	h := make([]byte, cuda.HandleSize)
	for _, tc := range []struct {
		name         string
		addr, n, off uint64
		handle       []byte
		want         string
	}{
		{"short handle", 1 << 40, 4096, 0, make([]byte, 10), "handle of 10 bytes"},
		{"empty", 1 << 40, 0, 0, h, "bad range"},
		{"wraps", 1<<64 - 4096, 8192, 0, h, "bad range"},
		{"offset past address", 4096, 4096, 8192, h, "bad range"},
		{"too large", 1 << 40, maxMemoryRegion + 1, 0, h, "too large"},
	} {
		if err := m.s.RegisterCUDA(tc.addr, tc.n, tc.handle, tc.off); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want %q", tc.name, err, tc.want)
		}
	}
	if g := m.gauge(); g != 0 {
		t.Fatalf("registered regions %v after refused registrations", g)
	}
}

// Without a driver (CI) the cuda kind fails cleanly naming the cause; with
// one (the GPU machine) a handle no process exported fails to open. Either
// way nothing stays registered.
func TestRegisterCUDAFailsCleanly(t *testing.T) {
	m := newMemSide(t, "tcp", time.Second)
	err := m.s.RegisterCUDA(1<<40, 4096, make([]byte, cuda.HandleSize), 0)
	if cuda.Load() != nil {
		if !errors.Is(err, cuda.ErrNoDriver) || !strings.Contains(err.Error(), "register cuda memory") {
			t.Fatalf("without a driver: %v", err)
		}
	} else if err == nil || !strings.Contains(err.Error(), "open IPC handle") {
		t.Fatalf("bogus handle: %v", err)
	}
	if g := m.gauge(); g != 0 {
		t.Fatalf("registered regions %v after a failed registration", g)
	}
	if err := m.s.Unregister(1 << 40); !errors.Is(err, ErrNotRegistered) {
		t.Fatalf("unregister of a failed registration: %v", err)
	}
}

func TestGPUKeyRoundTrip(t *testing.T) {
	var h cuda.Handle
	for i := range h {
		h[i] = byte(i + 1)
	}
	k := gpuKey(h, 12345, "boot-id")
	h2, off, host, err := parseGPUKey(k)
	if err != nil || !bytes.Equal(h2[:], h[:]) || off != 12345 || host != "boot-id" {
		t.Fatalf("round trip: %x %d %q %v", h2, off, host, err)
	}
	if _, _, _, err := parseGPUKey(k[:70]); err == nil {
		t.Fatal("short key parsed")
	}
}
