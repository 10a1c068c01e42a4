//go:build cgo

package kvtransfer

import (
	"context"
	"fmt"
	"testing"

	"github.com/pdrouter/pdrouter/kvtransfer/shm"
	"github.com/pdrouter/pdrouter/kvtransfer/wire"
)

// BenchmarkUCXWrite is one chunk of a 4k-token prompt in the default
// layout: 64 KV buffers, one 8 MiB put each, then the flush, between two
// UCX transports. "alloc" is the pool as kvproxy allocates it; "memfd"
// registers a memfd instead (the old design) to show what that costs.
// Compare with ucx_perftest -t ucp_put_bw -s 8388608 at the same UCX_TLS.
func BenchmarkUCXWrite(b *testing.B) {
	const bufs, run = 64, 8 << 20
	for _, tls := range []string{"posix,cma,tcp", "tcp"} {
		for _, mode := range []string{"alloc", "memfd"} {
			b.Run(fmt.Sprintf("%s/%s", tls, mode), func(b *testing.B) {
				b.Setenv("UCX_TLS", tls)
				pool := func(u *UCX) (*Pool, LocalMeta) {
					alloc := u.Alloc
					if mode == "memfd" {
						alloc = func(n int) (*shm.Segment, error) { return shm.Create("bench", n) }
					}
					seg, err := alloc(bufs * run)
					if err != nil {
						b.Fatal(err)
					}
					b.Cleanup(func() { _ = seg.Close() })
					p := &Pool{PageSize: 16, Dtype: "bf16"}
					for i := 0; i < bufs; i++ {
						mem := seg.Mem[i*run : (i+1)*run]
						clear(mem) // fault the pages in, as a used pool has them
						p.Regions = append(p.Regions, Region{Kind: wire.KindKV, ItemLen: 32 << 10, Mem: mem})
					}
					meta, err := u.Register(p)
					if err != nil {
						b.Fatal(err)
					}
					return p, meta
				}
				src, dst := newBenchUCX(b), newBenchUCX(b)
				_, _ = pool(src)
				dp, dm := pool(dst)
				// Cleanups run last-in first-out: the transports unregister the
				// pools before the segments go.
				b.Cleanup(func() { _ = src.Close(); _ = dst.Close() })
				h := &wire.Hello{WorkerAddr: dm.WorkerAddr}
				var runs []Run
				for i, r := range dp.Regions {
					h.Regions = append(h.Regions, wire.Region{Kind: r.Kind, Base: dm.Bases[i], Len: run, ItemLen: r.ItemLen, RKey: dm.RKeys[i]})
					runs = append(runs, Run{Region: i, Len: run})
				}
				w, err := src.Connect(h, nil)
				if err != nil {
					b.Fatal(err)
				}
				defer w.Close()
				ctx := context.Background()
				if err := w.Write(ctx, runs); err != nil { // wire-up, attach, first touch
					b.Fatal(err)
				}
				b.SetBytes(bufs * run)
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					if err := w.Write(ctx, runs); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}

func newBenchUCX(b *testing.B) *UCX {
	u, err := NewUCX()
	if err != nil {
		b.Skip(err)
	}
	return u
}
