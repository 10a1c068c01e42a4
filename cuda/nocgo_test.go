//go:build !cgo

package cuda

import (
	"errors"
	"testing"
)

func TestNoCgoIsNoDriver(t *testing.T) {
	if err := Load(); !errors.Is(err, ErrNoDriver) {
		t.Fatalf("Load: %v", err)
	}
	if _, err := Open(0); !errors.Is(err, ErrNoDriver) {
		t.Fatalf("Open: %v", err)
	}
}
