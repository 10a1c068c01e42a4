package kvtransfer

import (
	"context"
	"testing"
	"time"
)

// BenchmarkStagedWrite is 64 MiB contiguous: GPU stand-ins on two host ids
// (gather, DATA frames, scatter) against host memory over the same tcp
// link (DATA frames straight from the mapping), the staged path's wire.
func BenchmarkStagedWrite(b *testing.B) {
	const size = 64 << 20
	for _, chunk := range []int{1 << 20, 8 << 20} {
		b.Run("staged-chunk-"+itoa(chunk>>20)+"MiB", func(b *testing.B) {
			gpus := &hostGPUs{}
			opt := func(host string) func(*MemoryConfig) {
				return func(c *MemoryConfig) { c.GPUs, c.HostID, c.StageChunk = gpus, host, chunk }
			}
			a := newMemSide(b, "tcp", 30*time.Second, opt("a"))
			c := newMemSide(b, "tcp", 30*time.Second, opt("c"))
			src, dst := gpus.alloc(0, size), gpus.alloc(0, size)
			for _, x := range []struct {
				m    *memSide
				addr uint64
				al   *hostAlloc
			}{{a, srcBase, src}, {c, dstBase, dst}} {
				if err := x.m.s.RegisterCUDA(x.addr, size, x.al.handle[:], 0); err != nil {
					b.Fatal(err)
				}
			}
			ts := []Triple{{Src: srcBase, Dst: dstBase, Len: size}}
			b.SetBytes(size)
			for b.Loop() {
				if err := a.s.Write(context.Background(), c.p.PeerAddr(), ts); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
	b.Run("host-tcp", func(b *testing.B) {
		a, c := newMemSide(b, "tcp", 30*time.Second), newMemSide(b, "tcp", 30*time.Second)
		src, dupS := engineMemory(b, size)
		dst, dupD := engineMemory(b, size)
		a.register(b, src, dupS)
		c.register(b, dst, dupD)
		ts := []Triple{{Src: addrOf(src), Dst: addrOf(dst), Len: size}}
		b.SetBytes(size)
		for b.Loop() {
			if err := a.s.Write(context.Background(), c.p.PeerAddr(), ts); err != nil {
				b.Fatal(err)
			}
		}
	})
}

func itoa(n int) string {
	if n < 10 {
		return string(rune('0' + n))
	}
	return itoa(n/10) + string(rune('0'+n%10))
}
