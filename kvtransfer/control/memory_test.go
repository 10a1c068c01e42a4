package control

import (
	"bytes"
	"context"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/pdrouter/pdrouter/kvtransfer"
	"github.com/pdrouter/pdrouter/testkit/kvtest"
)

// memProxy is a kvproxy serving only engine-owned memory, and an engine
// connected to it.
type memProxy struct {
	plane *kvtransfer.MemoryPlane
	cl    *Client
	sock  string
}

func startMemProxy(t testing.TB, transport string) *memProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	tr := kvtransfer.Transport(&kvtransfer.TCP{})
	if transport == "shm" {
		tr = &kvtransfer.SHM{}
	}
	plane, err := kvtransfer.NewMemoryPlane(kvtransfer.MemoryConfig{Name: "m", Transport: tr, Listener: ln, WriteTimeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(t.TempDir(), "kvproxy.sock")
	uln, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	srv := &Server{Memory: plane}
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ctx, uln) }()
	m := &memProxy{plane: plane, sock: sock}
	if m.cl, err = Dial(sock); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		m.cl.Close()
		cancel()
		if err := <-served; err != nil {
			t.Error(err)
		}
		if err := plane.Close(); err != nil {
			t.Error(err)
		}
	})
	return m
}

// engineMem is engine memory as the Python client leaves it: a shared
// mapping of a memfd at the engine's own addresses.
func engineMem(t testing.TB, size int) ([]byte, int) {
	seg := kvtest.EngineMemory(t, size)
	return seg.Mem, seg.Fd()
}

var vaddr = kvtest.Addr

// memfds counts this process's fds and mappings of engine memfds: the
// test's own plus whatever the kvproxy side still holds.
func memfds(t *testing.T) (fds, maps int) {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		if l, err := os.Readlink("/proc/self/fd/" + e.Name()); err == nil && strings.HasPrefix(l, "/memfd:engine") {
			fds++
		}
	}
	b, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		t.Fatal(err)
	}
	return fds, strings.Count(string(b), "/memfd:engine")
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestEngineMemoryThroughControl(t *testing.T) {
	p, d := startMemProxy(t, "tcp"), startMemProxy(t, "tcp")
	ctx := context.Background()
	peer, tr, err := d.cl.Hello(ctx)
	if err != nil || peer != d.plane.PeerAddr() || tr != "tcp" {
		t.Fatalf("hello: %q %q %v", peer, tr, err)
	}
	if _, _, err := p.cl.Hello(ctx); err != nil {
		t.Fatal(err)
	}
	const size = 16 << 12
	src, srcFd := engineMem(t, size)
	for i := range src {
		src[i] = byte(i * 13)
	}
	dst, dstFd := engineMem(t, size)
	if err := p.cl.RegisterMemory(ctx, vaddr(src), size, srcFd); err != nil {
		t.Fatal(err)
	}
	if err := d.cl.RegisterMemory(ctx, vaddr(dst), size, dstFd); err != nil {
		t.Fatal(err)
	}
	if err := p.cl.Probe(ctx, peer); err != nil {
		t.Fatal(err)
	}
	if fds, maps := memfds(t); fds != 4 || maps != 4 {
		t.Fatalf("registered: %d memfd fds, %d mappings; want an fd and a mapping each side of each", fds, maps)
	}
	ts := []Triple{{Src: vaddr(src), Dst: vaddr(dst) + 4096, Len: 8192}, {Src: vaddr(src) + 8192, Dst: vaddr(dst) + 12288, Len: 100}}
	if err := p.cl.Write(ctx, peer, ts); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(dst[4096:12288], src[:8192]) || !bytes.Equal(dst[12288:12388], src[8192:8292]) || dst[0] != 0 {
		t.Fatal("bytes did not land where the triples said")
	}
	// Four writers at once on one connection, as SGLang's transfer threads.
	errc := make(chan error, 4)
	for i := range 4 {
		go func() {
			off := uint64(i) * 4096
			errc <- p.cl.Write(ctx, peer, []Triple{{Src: vaddr(src) + off, Dst: vaddr(dst) + off, Len: 4096}})
		}()
	}
	for range 4 {
		if err := <-errc; err != nil {
			t.Fatal(err)
		}
	}
	if !bytes.Equal(dst[:4*4096], src[:4*4096]) {
		t.Fatal("concurrent writes did not land")
	}
	if err := p.cl.Write(ctx, peer, []Triple{{Src: vaddr(src) + size, Dst: vaddr(dst), Len: 1}}); err == nil || !strings.Contains(err.Error(), "not registered") {
		t.Fatalf("write from unregistered memory: %v", err)
	}
	if err := p.cl.Write(ctx, "127.0.0.1:1", ts); err == nil {
		t.Fatal("write to a peer nobody listens on succeeded")
	}
	if err := d.cl.UnregisterMemory(ctx, vaddr(dst)); err != nil {
		t.Fatal(err)
	}
	if err := d.cl.UnregisterMemory(ctx, vaddr(dst)); err == nil {
		t.Fatal("second unregister succeeded")
	}
	if err := d.cl.RegisterCUDA(ctx, vaddr(dst), 4096, make([]byte, cudaHandleLen), 0); err == nil || !strings.Contains(err.Error(), "no CUDA driver") {
		t.Fatalf("cuda register: %v", err)
	}
	// The prefill engine goes away: its registration goes with it.
	if p.plane.Regions() != 1 {
		t.Fatalf("prefill regions %d", p.plane.Regions())
	}
	p.cl.Close()
	waitFor(t, "the closed connection's regions to go", func() bool { return p.plane.Regions() == 0 && p.plane.Mappings() == 0 })
	// A new connection registers again and works.
	if p.cl, err = Dial(p.sock); err != nil {
		t.Fatal(err)
	}
	if err := p.cl.RegisterMemory(ctx, vaddr(src), size, srcFd); err != nil {
		t.Fatal(err)
	}
	if err := d.cl.RegisterMemory(ctx, vaddr(dst), size, dstFd); err != nil {
		t.Fatal(err)
	}
	clear(dst)
	if err := p.cl.Write(ctx, peer, ts[:1]); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(dst[4096:12288], src[:8192]) {
		t.Fatal("write after re-registering did not land")
	}
	p.cl.Close()
	d.cl.Close()
	waitFor(t, "every region to go", func() bool { return p.plane.Regions()+d.plane.Regions() == 0 })
	// With no engine left, neither kvproxy keeps links to the other.
	waitFor(t, "the links to go", func() bool { return p.plane.Links()+d.plane.Links() == 0 })
	// Only the engines' own fds and mappings are left.
	if fds, maps := memfds(t); fds != 2 || maps != 2 {
		t.Fatalf("%d memfd fds and %d mappings open, want the engines' 2 and 2", fds, maps)
	}
}

func TestRoomAPINeedsRooms(t *testing.T) {
	m := startMemProxy(t, "tcp") // no room layer
	if err := m.cl.Expect(context.Background(), 1, "h:1", []uint32{1}, -1); err == nil || !strings.Contains(err.Error(), "no room API") {
		t.Fatalf("expect on a kvproxy without rooms: %v", err)
	}
}
