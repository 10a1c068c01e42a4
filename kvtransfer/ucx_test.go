//go:build cgo

package kvtransfer

import (
	"bytes"
	"testing"

	"github.com/pdrouter/pdrouter/kvtransfer/shm"
	"github.com/pdrouter/pdrouter/ucx"
)

func init() {
	transports["ucx"] = func() (Transport, error) { return NewUCX() }
}

func TestTransferUCX(t *testing.T) {
	for _, tls := range []string{"tcp", "posix,cma,tcp"} {
		t.Run(tls, func(t *testing.T) {
			t.Setenv("UCX_TLS", tls)
			testTransfer(t, "ucx")
		})
	}
	if l := ucx.LiveObjects(); l != (ucx.Live{}) {
		t.Fatalf("UCX objects leaked: %+v", l)
	}
}

// TestUCXAllocShared: over posix the pool is UCX's own segment, its fd maps
// the same pages in another mapping (the engine's), and every region shares
// one registration; over tcp UCX's memory is private, so the pool is a memfd.
func TestUCXAllocShared(t *testing.T) {
	for _, c := range []struct {
		tls     string
		ucxOwns bool
	}{{"posix,cma,tcp", true}, {"tcp", false}} {
		t.Run(c.tls, func(t *testing.T) {
			t.Setenv("UCX_TLS", c.tls)
			u, err := NewUCX()
			if err != nil {
				t.Skip(err)
			}
			p := testPool(t, u, 1)
			meta, err := u.Register(p)
			if err != nil {
				t.Fatal(err)
			}
			if got := u.alloc != nil; got != c.ucxOwns {
				t.Fatalf("pool allocated by UCX: %v, want %v", got, c.ucxOwns)
			}
			last := len(u.mems) - 1
			if one := u.mems[0] == u.mems[last] && bytes.Equal(meta.RKeys[0], meta.RKeys[last]); one != c.ucxOwns {
				t.Fatalf("regions share one registration and rkey: %v, want %v", one, c.ucxOwns)
			}
			// Map the segment again, as the engine does, and write through it.
			seg, err := shm.Find(p.Regions[0].Mem)
			if err != nil {
				t.Fatal(err)
			}
			dup, err := shm.Map(seg.Fd())
			if err != nil {
				t.Fatal(err)
			}
			dup.Mem[0] ^= 0xff
			if p.Regions[0].Mem[0] != dup.Mem[0] {
				t.Fatal("the engine's mapping does not alias the kvproxy's")
			}
			if err := dup.Close(); err != nil { // closes seg's fd too: Map took it
				t.Fatal(err)
			}
			if err := u.Close(); err != nil {
				t.Fatal(err)
			}
		})
	}
}

func TestShmAllowed(t *testing.T) {
	for tls, want := range map[string]bool{"": true, "tcp": false, "tcp,rc": false, "posix,cma,tcp": true, "sm": true, "^tcp": true, " cma , tcp": true} {
		if got := shmAllowed(tls); got != want {
			t.Errorf("shmAllowed(%q) = %v, want %v", tls, got, want)
		}
	}
}
