package kvtransfer

import (
	"context"
	"testing"
	"time"
)

// BenchmarkMemoryWrite moves a 64 MiB working set between two engines'
// memfd memory in one Write of SGLang-shaped triples (32 KiB = one page of
// one layer's K or V): "merged" has consecutive pages on both sides (few
// runs), "scattered" every other destination page (2048 runs). memcpy is
// the same bytes copied in process, the baseline of the same run.
func BenchmarkMemoryWrite(b *testing.B) {
	const size, item = 64 << 20, 32 << 10
	b.Run("memcpy", func(b *testing.B) {
		src, _ := engineMemory(b, size)
		dst, _ := engineMemory(b, size)
		fill(src, 1)
		copy(dst, src)
		b.SetBytes(size)
		b.ResetTimer()
		for b.Loop() {
			copy(dst, src)
		}
	})
	for _, tc := range benchTransports {
		for _, scattered := range []bool{false, true} {
			name := tc.name + "/merged"
			if scattered {
				name = tc.name + "/scattered"
			}
			b.Run(name, func(b *testing.B) {
				if tc.tls != "" {
					b.Setenv("UCX_TLS", tc.tls)
				}
				src, srcFd := engineMemory(b, size)
				dst, dstFd := engineMemory(b, 2*size)
				fill(src, 1)
				a, d := newMemSide(b, tc.transport, 30*time.Second, withPuts(tc.puts)), newMemSide(b, tc.transport, 30*time.Second, withPuts(tc.puts))
				a.register(b, src, srcFd)
				d.register(b, dst, dstFd)
				var ts []Triple
				for i := 0; i < size/item; i++ {
					dstPage := i
					if scattered {
						dstPage = 2 * i
					}
					ts = append(ts, Triple{Src: addrOf(src) + uint64(i*item), Dst: addrOf(dst) + uint64(dstPage*item), Len: item})
				}
				ctx := context.Background()
				if err := a.s.Write(ctx, d.p.PeerAddr(), ts); err != nil { // link, endpoint and keys up
					b.Fatal(err)
				}
				b.SetBytes(size)
				b.ResetTimer()
				for b.Loop() {
					if err := a.s.Write(ctx, d.p.PeerAddr(), ts); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}

// BenchmarkMemoryWriteSmall is the per-call cost: one 4 KiB triple, link up.
func BenchmarkMemoryWriteSmall(b *testing.B) {
	for _, tc := range benchTransports {
		b.Run(tc.name, func(b *testing.B) {
			if tc.tls != "" {
				b.Setenv("UCX_TLS", tc.tls)
			}
			src, srcFd := engineMemory(b, page)
			dst, dstFd := engineMemory(b, page)
			a, d := newMemSide(b, tc.transport, 30*time.Second, withPuts(tc.puts)), newMemSide(b, tc.transport, 30*time.Second, withPuts(tc.puts))
			a.register(b, src, srcFd)
			d.register(b, dst, dstFd)
			ts := []Triple{{Src: addrOf(src), Dst: addrOf(dst), Len: page}}
			ctx := context.Background()
			if err := a.s.Write(ctx, d.p.PeerAddr(), ts); err != nil {
				b.Fatal(err)
			}
			b.ResetTimer()
			for b.Loop() {
				if err := a.s.Write(ctx, d.p.PeerAddr(), ts); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// benchTransports: ucx moves host memory by DATA frames unless it has an rc
// or dc lane; -puts by its own puts anyway.
var benchTransports = []struct {
	name, transport, tls string
	puts                 bool
}{
	{"tcp", "tcp", "", false}, {"shm", "shm", "", false}, {"ucx-tcp", "ucx", "tcp", false}, {"ucx-tcp-puts", "ucx", "tcp", true},
	{"ucx-shm", "ucx", "posix,cma,tcp", false}, {"ucx-shm-puts", "ucx", "posix,cma,tcp", true},
}
