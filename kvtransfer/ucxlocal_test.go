//go:build cgo

package kvtransfer

import (
	"bytes"
	"context"
	"errors"
	"net"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/pdrouter/pdrouter/ucx"
)

// localSide is a plane on UCXLocalSHM with host id host; puts: host
// memory by UCX's puts where shm does not apply.
func localSide(t *testing.T, host string, puts bool) *memSide {
	t.Helper()
	tr, err := NewUCXLocalSHM(host)
	if err != nil {
		t.Skipf("ucx: %v", err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	p, err := NewMemoryPlane(MemoryConfig{Name: host, Transport: tr, Listener: ln, WriteTimeout: 5 * time.Second, Registry: reg, HostID: host, TransportPuts: puts})
	if err != nil {
		t.Fatal(err)
	}
	m := &memSide{p: p, s: p.NewSession(), tr: tr, reg: reg}
	t.Cleanup(func() {
		if err := errors.Join(m.p.Close(), m.tr.Close()); err != nil {
			t.Error(err)
		}
	})
	return m
}

// TestUCXLocalSHMPicksPerPeer: between planes of one host id host memory
// goes by shm's memcpy, between two host ids by UCX (its puts here), and
// each link names the path it takes; no UCX object outlives the planes.
func TestUCXLocalSHMPicksPerPeer(t *testing.T) {
	t.Setenv("UCX_TLS", "posix,cma,tcp")
	for _, tc := range []struct {
		hostB string
		want  Path
	}{{"h1", PathSHM}, {"h2", PathUCX}} {
		t.Run(tc.hostB, func(t *testing.T) {
			a, b := localSide(t, "h1", true), localSide(t, tc.hostB, true)
			src, dst := a.memory(t, 16*page), b.memory(t, 16*page)
			fill(src, 7)
			for range 2 { // the second write reuses the endpoint and keys
				clear(dst)
				if err := a.s.Write(context.Background(), b.p.PeerAddr(), []Triple{{Src: addrOf(src), Dst: addrOf(dst), Len: 16 * page}}); err != nil {
					t.Fatal(err)
				}
				if !bytes.Equal(src, dst) {
					t.Fatal("the write did not land")
				}
			}
			st := a.p.Paths()
			want := PairPath{Src: "host@h1", Dst: "host@" + tc.hostB, Path: tc.want}
			if len(st.Links) != 1 || len(st.Links[0].Paths) != 1 || st.Links[0].Paths[0] != want {
				t.Fatalf("paths %+v, want %+v", st, want)
			}
		})
	}
	if l := ucx.LiveObjects(); l != (ucx.Live{}) {
		t.Fatalf("UCX objects leaked: %+v", l)
	}
}

// TestUCXStartsSmallWrites: kvproxy's ucx transport starts a small write
// as the path to the peer allows: to a kvproxy of the same host a copy
// (done when Start returns), to another host without zero-copy puts DATA
// frames the link's reader answers (issue 28's small write over ucx).
func TestUCXStartsSmallWrites(t *testing.T) {
	t.Setenv("UCX_TLS", "tcp")
	for _, tc := range []struct {
		hostB  string
		inline bool
	}{{"h1", true}, {"h2", false}} {
		t.Run(tc.hostB, func(t *testing.T) {
			a, b := localSide(t, "h1", false), localSide(t, tc.hostB, false)
			src, dst := a.memory(t, page), b.memory(t, page)
			ts := []Triple{{Src: addrOf(src), Dst: addrOf(dst), Len: 64}}
			if err := a.s.Write(context.Background(), b.p.PeerAddr(), ts); err != nil {
				t.Fatal(err)
			}
			src[0] = 5
			ch, ok := startWrite(a.s, b.p.PeerAddr(), ts)
			if !ok {
				t.Fatal("a small write on a link that is up is not started")
			}
			// Over tcp the answer may come before Start returns: only who
			// ran done tells the paths apart.
			if r := <-ch; r.err != nil || tc.inline && !r.inline || r.onReader == tc.inline || dst[0] != 5 {
				t.Fatalf("%v, done when Start returned: %t, by the link's reader: %t, byte %d", r.err, r.inline, r.onReader, dst[0])
			}
		})
	}
}

// kvproxy's staging rings have no memfd: UCXLocalSHM registers them with
// UCX alone, and a peer on another host puts into them (staged-ucx).
func TestUCXLocalSHMRegistersMemoryWithoutAMemfd(t *testing.T) {
	t.Setenv("UCX_TLS", "tcp")
	a, err := NewUCXLocalSHM("h1")
	if err != nil {
		t.Skipf("ucx: %v", err)
	}
	b, err := NewUCXLocalSHM("h2")
	if err != nil {
		t.Fatal(err)
	}
	src, _ := engineMemory(t, 64<<10)
	ring, _ := engineMemory(t, 64<<10)
	fill(src, 3)
	sreg, err := a.RegisterMemory(src, -1)
	if err != nil {
		t.Fatal(err)
	}
	rreg, err := b.RegisterMemory(ring, -1)
	if err != nil {
		t.Fatalf("a ring without a memfd: %v", err)
	}
	addr, err := b.WorkerAddress()
	if err != nil {
		t.Fatal(err)
	}
	ep, err := a.MemoryEndpoint(addr)
	if err != nil {
		t.Fatal(err)
	}
	key, err := ep.Unpack(rreg.RKey())
	if err != nil {
		t.Fatal(err)
	}
	if err := ep.Put(context.Background(), []MemoryOp{{Local: sreg, Key: key, Remote: addrOf(ring), Len: uint64(len(src))}}); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(src, ring) {
		t.Fatal("the put did not land in the ring")
	}
	ep.Forget(key)
	ep.Close()
	if err := errors.Join(sreg.Close(), rreg.Close(), a.Close(), b.Close()); err != nil {
		t.Fatal(err)
	}
	if l := ucx.LiveObjects(); l != (ucx.Live{}) {
		t.Fatalf("UCX objects leaked: %+v", l)
	}
}
