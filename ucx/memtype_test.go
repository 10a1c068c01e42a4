//go:build cgo

package ucx

import (
	"bytes"
	"strings"
	"testing"
	"time"
	"unsafe"
)

func TestMapAddrHostIsPutTarget(t *testing.T) {
	p := newPair(t, "tcp")
	const n = 1<<20 + 5
	buf := mmapBytes(t, n)
	dst, err := p.ctx.MapAddr(uintptr(unsafe.Pointer(&buf[0])), n, MemoryHost)
	must(t, err)
	defer dst.Close()
	if dst.Type() != MemoryHost || dst.Addr() != uint64(uintptr(unsafe.Pointer(&buf[0]))) || dst.Len() != n {
		t.Fatalf("mapped region: type %v addr %#x len %d", dst.Type(), dst.Addr(), dst.Len())
	}
	src, err := p.ctx.Alloc(n)
	must(t, err)
	defer src.Close()
	fill(src.Bytes(), 9)
	rk := p.remote(t, dst)
	must(t, p.cli.Do(func(w *Worker) error {
		req, err := p.cep.Put(src, 0, rk, dst.Addr(), n)
		if err != nil {
			return err
		}
		req.Free()
		f, err := p.cep.Flush()
		if err != nil {
			return err
		}
		return f.Wait(20 * time.Second)
	}))
	if !bytes.Equal(buf, src.Bytes()) {
		t.Fatal("put into memory mapped by address: target differs from source")
	}
}

// A UCX without CUDA transports (Debian's, or any with UCX_TLS lacking
// cuda_copy) must refuse CUDA memory with a clear error, registering nothing.
func TestMapAddrCUDARefusedWithoutCUDATransport(t *testing.T) {
	ctx := newContext(t, "tcp")
	defer func() { must(t, ctx.Close()) }()
	if ctx.Supports(MemoryCUDA) {
		t.Fatal("a tcp-only context claims CUDA memory support")
	}
	if !ctx.Supports(MemoryHost) {
		t.Fatal("context does not report host memory support")
	}
	before := LiveObjects().Memory
	buf := mmapBytes(t, 4096)
	m, err := ctx.MapAddr(uintptr(unsafe.Pointer(&buf[0])), 4096, MemoryCUDA)
	if err == nil {
		m.Close()
		t.Fatal("MapAddr of CUDA memory succeeded without a CUDA transport")
	}
	if !strings.Contains(err.Error(), "cannot register cuda memory") || !strings.Contains(err.Error(), APIVersion()) {
		t.Fatalf("unclear error: %v", err)
	}
	if got := LiveObjects().Memory; got != before {
		t.Fatalf("memory regions %d after a refused map, want %d", got, before)
	}
}

func TestMapAddrBadRange(t *testing.T) {
	ctx := newContext(t, "tcp")
	defer func() { must(t, ctx.Close()) }()
	for _, tc := range []struct {
		addr uintptr
		n    int
	}{{0, 4096}, {4096, 0}, {4096, -1}} {
		if m, err := ctx.MapAddr(tc.addr, tc.n, MemoryHost); err == nil || !strings.Contains(err.Error(), "bad range") {
			if m != nil {
				m.Close()
			}
			t.Errorf("MapAddr(%#x, %d): %v, want a bad range error", tc.addr, tc.n, err)
		}
	}
}

func TestAPIVersionAndTypeNames(t *testing.T) {
	if v := APIVersion(); !strings.HasPrefix(v, "1.") {
		t.Fatalf("APIVersion %q, want 1.x", v)
	}
	if MemoryHost.String() != "host" || MemoryCUDA.String() != "cuda" || !strings.Contains(MemoryType(7).String(), "7") {
		t.Fatal("memory type names")
	}
	// The C side's memory type numbers must be UCX's: host 0, cuda 1 in every UCX since 1.9.
	if ucsMemType(MemoryHost) != 0 || ucsMemType(MemoryCUDA) != 1 {
		t.Fatalf("ucs memory types %d %d", ucsMemType(MemoryHost), ucsMemType(MemoryCUDA))
	}
}
