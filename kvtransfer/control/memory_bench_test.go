package control

import (
	"context"
	"testing"
)

// BenchmarkControlWrite is what one Mooncake-style call costs through the
// control socket: a 4 KiB OpWrite between two kvproxies, link up; compare
// with kvtransfer's BenchmarkMemoryWriteSmall (the same write without the
// socket).
func BenchmarkControlWrite(b *testing.B) {
	for _, transport := range []string{"tcp", "shm"} {
		b.Run(transport, func(b *testing.B) {
			p, d := startMemProxy(b, transport), startMemProxy(b, transport)
			ctx := context.Background()
			src, srcFd := engineMem(b, 4096)
			dst, dstFd := engineMem(b, 4096)
			if err := p.cl.RegisterMemory(ctx, vaddr(src), 4096, srcFd); err != nil {
				b.Fatal(err)
			}
			if err := d.cl.RegisterMemory(ctx, vaddr(dst), 4096, dstFd); err != nil {
				b.Fatal(err)
			}
			peer := d.plane.PeerAddr()
			ts := []Triple{{Src: vaddr(src), Dst: vaddr(dst), Len: 4096}}
			if err := p.cl.Write(ctx, peer, ts); err != nil {
				b.Fatal(err)
			}
			b.ResetTimer()
			for b.Loop() {
				if err := p.cl.Write(ctx, peer, ts); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
