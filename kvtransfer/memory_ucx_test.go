//go:build cgo

package kvtransfer

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/pdrouter/pdrouter/ucx"
)

// TestMemoryUCXPeerLoss: over ucx, a write to a kvproxy that went away
// fails within the write timeout, the writer's link and endpoint go, a new
// peer works, and no UCX object outlives the planes.
func TestMemoryUCXPeerLoss(t *testing.T) {
	for _, tls := range []string{"tcp", "posix,cma,tcp"} {
		t.Run(tls, func(t *testing.T) {
			t.Setenv("UCX_TLS", tls)
			const timeout = time.Second
			a := newMemSide(t, "ucx", timeout, withPuts(true))
			src := a.memory(t, 16*page)
			fill(src, 5)
			b := newMemSide(t, "ucx", timeout, withPuts(true))
			dst := b.memory(t, 16*page)
			ts := []Triple{{Src: addrOf(src), Dst: addrOf(dst), Len: 16 * page}}
			ctx := context.Background()
			if err := a.s.Write(ctx, b.p.PeerAddr(), ts); err != nil {
				t.Fatal(err)
			}
			peer := b.p.PeerAddr()
			// The decode engine goes, then its kvproxy.
			if err := b.s.Close(); err != nil {
				t.Fatal(err)
			}
			if b.gauge() != 0 || b.p.Mappings() != 1 {
				t.Fatalf("after the engine left: gauge %v, mappings %d (one in quarantine)", b.gauge(), b.p.Mappings())
			}
			if err := b.p.Close(); err != nil {
				t.Fatal(err)
			}
			if b.p.Mappings() != 1 {
				t.Fatalf("%d mappings after close, want the quarantined one", b.p.Mappings())
			}
			// As a killed kvproxy's would, the link breaks at once.
			deadline := time.Now().Add(5 * time.Second)
			for a.p.Links() != 0 && time.Now().Before(deadline) {
				time.Sleep(5 * time.Millisecond)
			}
			t0 := time.Now()
			if err := a.s.Write(ctx, peer, ts); err == nil || time.Since(t0) > 3*timeout {
				t.Fatalf("write to a closed peer: %v after %s", err, time.Since(t0))
			}
			c := newMemSide(t, "ucx", timeout, withPuts(true))
			dst2 := c.memory(t, 16*page)
			if err := a.s.Write(ctx, c.p.PeerAddr(), []Triple{{Src: addrOf(src), Dst: addrOf(dst2), Len: 16 * page}}); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(dst2, src) {
				t.Fatal("write to the new peer did not land")
			}
			for _, m := range []*memSide{a, c} {
				if err := m.p.Close(); err != nil {
					t.Fatal(err)
				}
			}
			for _, m := range []*memSide{a, b, c} {
				if err := m.tr.Close(); err != nil {
					t.Fatal(err)
				}
				m.tr = &TCP{} // closed: the cleanup closes this instead
			}
			if l := ucx.LiveObjects(); l != (ucx.Live{}) {
				t.Fatalf("UCX objects leaked: %+v", l)
			}
		})
	}
}
