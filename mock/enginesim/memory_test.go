package enginesim

import (
	"context"
	"encoding/binary"
	"errors"
	"flag"
	"strings"
	"testing"

	"github.com/pdrouter/pdrouter/cuda"
)

func TestParseMemory(t *testing.T) {
	for in, want := range map[string]int{"": -1, "host": -1, "cuda:0": 0, "cuda:7": 7} {
		if got, err := parseMemory(in); err != nil || got.device != want {
			t.Errorf("parseMemory(%q) = %+v, %v; want device %d", in, got, err, want)
		}
	}
	for _, bad := range []string{"cuda", "cuda:", "cuda:-1", "cuda:x", "cuda:01", "gpu:0", "HOST", "cuda:1 "} {
		if _, err := parseMemory(bad); err == nil {
			t.Errorf("parseMemory(%q) accepted", bad)
		}
	}
	var o Options
	fs := flag.NewFlagSet("mock", flag.ContinueOnError)
	o.RegisterFlags(fs)
	kv, rest := SplitArgs([]string{"--port", "1", "--kv-memory", "cuda:1", "--kvproxy=/s"})
	if err := fs.Parse(kv); err != nil || o.Memory != "cuda:1" || len(rest) != 2 {
		t.Fatalf("flags: %+v %v, rest %v", o, err, rest)
	}
}

// fakeGPU is device memory in host memory, counting what the engine does
// with it.
type fakeGPU struct {
	mem           []byte
	base          uint64
	copies, frees int
	closed        bool
}

func (g *fakeGPU) Alloc(n int) (uint64, error) {
	g.mem, g.base = make([]byte, n), 0x7f0000000000
	return g.base, nil
}

func (g *fakeGPU) Free(ptr uint64) error {
	if ptr != g.base || g.mem == nil {
		return errors.New("free of no allocation")
	}
	g.mem = nil
	g.frees++
	return nil
}

func (g *fakeGPU) IPCHandle(ptr uint64) (cuda.Handle, error) {
	var h cuda.Handle
	binary.LittleEndian.PutUint64(h[:], ptr)
	return h, nil
}

func (g *fakeGPU) at(ptr uint64, n int) []byte { return g.mem[ptr-g.base:][:n] }

func (g *fakeGPU) CopyFromHost(dst uint64, src []byte) error {
	g.copies++
	copy(g.at(dst, len(src)), src)
	return nil
}

func (g *fakeGPU) CopyToHost(dst []byte, src uint64) error {
	g.copies++
	copy(dst, g.at(src, len(dst)))
	return nil
}

func (g *fakeGPU) Close() error { g.closed = true; return nil }

// TestDevicePagesRoundTrip: pages written to device buffers read back the
// same, a run of consecutive pages moves in one copy, and a page that
// changed on the device fails its check.
func TestDevicePagesRoundTrip(t *testing.T) {
	g := &fakeGPU{}
	const item, span = 64, 64 * 16
	d, err := newDeviceBuffers(g, 2, span, item)
	if err != nil {
		t.Fatal(err)
	}
	pages := []uint32{3, 4, 5, 9, 1}
	pattern := func(b, i int) byte { return byte(b*50 + i*7 + 1) }
	for b := range 2 {
		if err := d.write(b, pages, func(i int, p []byte) { p[0], p[item-1] = pattern(b, i), pattern(b, i) }); err != nil {
			t.Fatal(err)
		}
	}
	if g.copies != 2*(3+1) {
		t.Fatalf("%d copies for 3 runs in 2 buffers, want 8 (a fence each)", g.copies)
	}
	if got := g.at(d.addr(1, 9), item); got[0] != pattern(1, 3) {
		t.Fatalf("buffer 1 page 9 holds %d, want %d", got[0], pattern(1, 3))
	}
	check := func(b int) bool {
		ok, err := d.read(b, pages, func(i int, p []byte) bool { return p[0] == pattern(b, i) && p[item-1] == pattern(b, i) })
		if err != nil {
			t.Fatal(err)
		}
		return ok
	}
	if !check(0) || !check(1) {
		t.Fatal("pages did not read back")
	}
	g.at(d.addr(0, 5), item)[item-1]++
	if check(0) {
		t.Fatal("a page changed on the device passed its check")
	}
	if err := d.close(); err != nil || g.frees != 1 || !g.closed {
		t.Fatalf("close: %v, %d frees, closed %v", err, g.frees, g.closed)
	}
}

// TestCUDAMemoryAgainstAKvproxyWithoutGPU: an engine asked for cuda memory
// whose kvproxy cannot open it (no CUDA driver here) fails to start,
// saying why, and gives its device memory back; on this machine the real
// driver is not there either, which New says.
func TestCUDAMemoryAgainstAKvproxyWithoutGPU(t *testing.T) {
	ps := proxy(t, "prefill")
	g := &fakeGPU{}
	o := opts(ps.Addrs().Control)
	o.Memory, o.openGPU = "cuda:0", func(n int) (gpu, error) {
		if n != 0 {
			t.Errorf("opened device %d, want 0", n)
		}
		return g, nil
	}
	if _, err := New(context.Background(), o); err == nil || !strings.Contains(err.Error(), "CUDA") {
		t.Fatalf("New with cuda memory a kvproxy cannot open: %v", err)
	}
	if g.frees != 1 || !g.closed {
		t.Fatalf("device memory left: %d frees, closed %v", g.frees, g.closed)
	}
	if n, _ := cuda.DeviceCount(); n == 0 {
		o.openGPU = nil
		if _, err := New(context.Background(), o); err == nil || !strings.Contains(err.Error(), "--kv-memory cuda:0") {
			t.Fatalf("New with cuda memory and no GPU: %v", err)
		}
	}
	o.Memory = "gpu"
	if _, err := New(context.Background(), o); err == nil || !strings.Contains(err.Error(), "want host or cuda:N") {
		t.Fatalf("New with a bad --kv-memory: %v", err)
	}
}
