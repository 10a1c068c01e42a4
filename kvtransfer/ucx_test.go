//go:build cgo

package kvtransfer

import (
	"testing"
)

func init() {
	transports["ucx"] = func() (Transport, error) { return NewUCX() }
}

func TestShmAllowed(t *testing.T) {
	for tls, want := range map[string]bool{"": true, "tcp": false, "tcp,rc": false, "posix,cma,tcp": true, "sm": true, "^tcp": true, " cma , tcp": true} {
		if got := shmAllowed(tls); got != want {
			t.Errorf("shmAllowed(%q) = %v, want %v", tls, got, want)
		}
	}
}
