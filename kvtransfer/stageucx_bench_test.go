//go:build cgo

package kvtransfer

import (
	"context"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// BenchmarkStagedUCX is 64 MiB over UCX's tcp lanes (UCX_TLS=tcp, both
// ends in this process): the staged-ucx path on stand-in GPUs (gather,
// puts into the receiver's ring, scatter), against the same bytes put by
// our UCX transport from registered host memory as 1 MiB puts, under one
// flush (UCX's own put rate on this box, the ceiling in the same run) and
// a window of them each with its flush (the staged path's puts alone).
// wire-busy-% is the share of the staged writes' time with a put in
// flight: a ring that drains every round shows as idle wire.
func BenchmarkStagedUCX(b *testing.B) {
	const size, chunk = 64 << 20, 1 << 20
	b.Setenv("UCX_TLS", "tcp")
	b.Run("ucx-puts", func(b *testing.B) {
		w, r := newTransport(b, "ucx").(*UCX), newTransport(b, "ucx").(*UCX)
		defer r.Close()
		defer w.Close() // after the endpoint
		src, dst := anonMemory(b, size), anonMemory(b, size)
		sreg, err := w.RegisterMemory(src, -1)
		if err != nil {
			b.Fatal(err)
		}
		defer sreg.Close()
		dreg, err := r.RegisterMemory(dst, -1)
		if err != nil {
			b.Fatal(err)
		}
		defer dreg.Close()
		addr, err := r.WorkerAddress()
		if err != nil {
			b.Fatal(err)
		}
		ep, err := w.MemoryEndpoint(addr)
		if err != nil {
			b.Fatal(err)
		}
		defer ep.Close()
		key, err := ep.Unpack(dreg.RKey())
		if err != nil {
			b.Fatal(err)
		}
		var ops []MemoryOp
		for off := uint64(0); off < size; off += chunk {
			ops = append(ops, MemoryOp{Local: sreg, LocalOff: off, Key: key, Remote: addrOf(dst) + off, Len: chunk})
		}
		b.Run("one-flush", func(b *testing.B) {
			b.SetBytes(size)
			for b.Loop() {
				if err := ep.Put(context.Background(), ops); err != nil {
					b.Fatal(err)
				}
			}
		})
		// As the staged path puts: a flush per put, a window in flight.
		b.Run("window", func(b *testing.B) {
			b.SetBytes(size)
			for b.Loop() {
				window := make(chan struct{}, stageWindow)
				errs := make(chan error, len(ops))
				for i := range ops {
					window <- struct{}{}
					go func() {
						errs <- ep.Put(context.Background(), ops[i:i+1])
						<-window
					}()
				}
				for range ops {
					if err := <-errs; err != nil {
						b.Fatal(err)
					}
				}
			}
		})
	})
	b.Run("staged-ucx", func(b *testing.B) {
		gpus := &hostGPUs{}
		opt := func(host string) func(*MemoryConfig) {
			return func(c *MemoryConfig) { c.GPUs, c.HostID, c.StageChunk, c.TransportPuts = gpus, host, chunk, true }
		}
		a, c := newMemSide(b, "ucx-counted", 30*time.Second, opt("a")), newMemSide(b, "ucx", 30*time.Second, opt("c"))
		src, dst := gpus.alloc(0, size), gpus.alloc(1, size)
		a.registerGPU(b, srcBase, src)
		c.registerGPU(b, dstBase, dst)
		ts := []Triple{{Src: srcBase, Dst: dstBase, Len: size}}
		b.SetBytes(size)
		puts := a.tr.(*countedUCX)
		busy0, start := puts.busyFor(), time.Now()
		for b.Loop() {
			if err := a.s.Write(context.Background(), c.p.PeerAddr(), ts); err != nil {
				b.Fatal(err)
			}
		}
		// The share of the writes' time with a put on the wire: what the
		// ring's round trips leave of UCX's put rate, whatever this box's.
		b.ReportMetric(100*float64(puts.busyFor()-busy0)/float64(time.Since(start)), "wire-busy-%")
	})
}

// anonMemory is n bytes of anonymous mapping, unmapped at cleanup.
func anonMemory(b *testing.B, n int) []byte {
	m, err := unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = unix.Munmap(m) })
	return m
}
