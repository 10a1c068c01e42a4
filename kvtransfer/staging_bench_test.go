package kvtransfer

import (
	"context"
	"os"
	"syscall"
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

// BenchmarkStagedPages is 32 MiB as 32 KiB pages (SGLang's Llama-3.1-8B
// page of one buffer), contiguous and every other page, over the staged
// path on stand-in GPUs: every other page's rate against contiguous's is
// what the per-page work of the path costs.
func BenchmarkStagedPages(b *testing.B) {
	const size, pg = 64 << 20, 32 << 10
	for _, tr := range []string{"tcp", "ucx"} {
		for _, pattern := range []string{"contiguous", "every-other"} {
			b.Run(tr+"/"+pattern, func(b *testing.B) {
				if tr == "ucx" && os.Getenv("UCX_TLS") == "" {
					b.Setenv("UCX_TLS", "tcp")
				}
				gpus := &hostGPUs{}
				opt := func(host string) func(*MemoryConfig) {
					return func(c *MemoryConfig) { c.GPUs, c.HostID = gpus, host }
				}
				a := newMemSide(b, tr, 30*time.Second, opt("a"))
				c := newMemSide(b, tr, 30*time.Second, opt("c"))
				src, dst := gpus.alloc(0, size), gpus.alloc(0, size)
				a.registerGPU(b, srcBase, src)
				c.registerGPU(b, dstBase, dst)
				w := &PageWrite{Bufs: []PageBuf{{Src: srcBase, Dst: dstBase, PageLen: pg}}}
				for i := uint32(0); i < size/pg/2; i++ {
					if pattern == "contiguous" {
						w.Pairs = append(w.Pairs, PagePair{Src: i, Dst: i})
					} else {
						w.Pairs = append(w.Pairs, PagePair{Src: 2 * i, Dst: 2*i + 1})
					}
				}
				b.SetBytes(int64(w.Bytes()))
				cpu0 := cpuTime()
				for b.Loop() {
					if err := a.s.WritePages(context.Background(), c.p.PeerAddr(), w); err != nil {
						b.Fatal(err)
					}
				}
				// CPU time (both ends, one process) is what the path costs on
				// a busy machine, where wall time measures the neighbours.
				b.ReportMetric(float64(cpuTime()-cpu0)/float64(b.N)/float64(w.Bytes()>>20), "cpu-ns/MiB")
			})
		}
	}
}

// cpuTime is the process's user and system CPU time so far.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func itoa(n int) string {
	if n < 10 {
		return string(rune('0' + n))
	}
	return itoa(n/10) + string(rune('0'+n%10))
}
