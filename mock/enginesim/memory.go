package enginesim

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/pdrouter/pdrouter/cuda"
	"github.com/pdrouter/pdrouter/kvtransfer/control"
)

// Where the KV buffers live (--kv-memory): "host", a memfd the engine maps
// and passes to its kvproxy, or "cuda:N", memory of device N that the
// engine allocates and registers by CUDA IPC handle, as SGLang does with
// its GPU KV pool. The aux buffer is host memory either way (SGLang's is).

// memorySpec is a parsed --kv-memory.
type memorySpec struct {
	device int // -1: host
}

func parseMemory(s string) (memorySpec, error) {
	if s == "" || s == "host" {
		return memorySpec{device: -1}, nil
	}
	ord, ok := strings.CutPrefix(s, "cuda:")
	n, err := strconv.Atoi(ord)
	if !ok || err != nil || n < 0 || strconv.Itoa(n) != ord {
		return memorySpec{}, fmt.Errorf("--kv-memory %q: want host or cuda:N", s)
	}
	return memorySpec{device: n}, nil
}

// kvBuffers are the pool's KV buffers: write fills pages of buffer b
// (fill(i, page) for pages[i]), read hands each to check and reports
// whether every check passed.
type kvBuffers interface {
	write(b int, pages []uint32, fill func(i int, page []byte)) error
	read(b int, pages []uint32, check func(i int, page []byte) bool) (bool, error)
	// register registers the buffers with the kvproxy behind cl.
	register(ctx context.Context, cl *control.Client) error
	close() error
}

// hostBuffers are KV buffers in the pool's memfd, registered with its aux
// buffer as one region.
type hostBuffers struct {
	bufs [][]byte
	item int
}

func (h *hostBuffers) write(b int, pages []uint32, fill func(int, []byte)) error {
	for i, p := range pages {
		fill(i, h.bufs[b][int(p)*h.item:][:h.item])
	}
	return nil
}

func (h *hostBuffers) read(b int, pages []uint32, check func(int, []byte) bool) (bool, error) {
	for i, p := range pages {
		if !check(i, h.bufs[b][int(p)*h.item:][:h.item]) {
			return false, nil
		}
	}
	return true, nil
}

func (*hostBuffers) register(context.Context, *control.Client) error { return nil } // with the memfd
func (*hostBuffers) close() error                                    { return nil }

// gpu is the slice of a CUDA device the mock engine uses (*cuda.Device).
type gpu interface {
	Alloc(n int) (uint64, error)
	Free(ptr uint64) error
	IPCHandle(ptr uint64) (cuda.Handle, error)
	CopyFromHost(dst uint64, src []byte) error
	CopyToHost(dst []byte, src uint64) error
	Close() error
}

func openCUDA(ordinal int) (gpu, error) {
	d, err := cuda.Open(ordinal)
	if err != nil {
		return nil, err
	}
	return d, nil
}

// deviceBuffers are KV buffers in one device allocation: buffer b is
// span bytes at base+b*span. Pages are staged through host memory, one
// copy per run of consecutive pages.
type deviceBuffers struct {
	dev        gpu
	base       uint64
	span, item int
	nbuf       int
	handle     cuda.Handle
}

func newDeviceBuffers(dev gpu, nbuf, span, item int) (*deviceBuffers, error) {
	base, err := dev.Alloc(nbuf * span)
	if err != nil {
		return nil, errors.Join(fmt.Errorf("allocate %d bytes of KV on the GPU: %w", nbuf*span, err), dev.Close())
	}
	h, err := dev.IPCHandle(base)
	if err != nil {
		return nil, errors.Join(fmt.Errorf("IPC handle of the KV pool: %w", err), dev.Free(base), dev.Close())
	}
	return &deviceBuffers{dev: dev, base: base, span: span, item: item, nbuf: nbuf, handle: h}, nil
}

// runs calls f for each run of consecutive pages: pages[i:j] are pages[i],
// pages[i]+1, ...
func runs(pages []uint32, f func(i, j int) error) error {
	for i := 0; i < len(pages); {
		j := i + 1
		for j < len(pages) && pages[j] == pages[j-1]+1 {
			j++
		}
		if err := f(i, j); err != nil {
			return err
		}
		i = j
	}
	return nil
}

func (d *deviceBuffers) addr(b int, p uint32) uint64 {
	return d.base + uint64(b*d.span) + uint64(p)*uint64(d.item)
}

func (d *deviceBuffers) write(b int, pages []uint32, fill func(int, []byte)) error {
	err := runs(pages, func(i, j int) error {
		stage := make([]byte, (j-i)*d.item)
		for k := i; k < j; k++ {
			fill(k, stage[(k-i)*d.item:][:d.item])
		}
		return d.dev.CopyFromHost(d.addr(b, pages[i]), stage)
	})
	if err != nil || len(pages) == 0 {
		return err
	}
	// A copy from pageable memory may return before its DMA lands; a copy
	// back on the same stream waits for it, so the kvproxy (another
	// process) reads the pages whole.
	var fence [1]byte
	return d.dev.CopyToHost(fence[:], d.addr(b, pages[len(pages)-1]))
}

func (d *deviceBuffers) read(b int, pages []uint32, check func(int, []byte) bool) (bool, error) {
	ok := true
	err := runs(pages, func(i, j int) error {
		stage := make([]byte, (j-i)*d.item)
		if err := d.dev.CopyToHost(stage, d.addr(b, pages[i])); err != nil {
			return err
		}
		for k := i; k < j && ok; k++ {
			ok = check(k, stage[(k-i)*d.item:][:d.item])
		}
		return nil
	})
	return ok && err == nil, err
}

func (d *deviceBuffers) register(ctx context.Context, cl *control.Client) error {
	return cl.RegisterCUDA(ctx, d.base, uint64(d.nbuf*d.span), d.handle[:], 0)
}

func (d *deviceBuffers) close() error { return errors.Join(d.dev.Free(d.base), d.dev.Close()) }
