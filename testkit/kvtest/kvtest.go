// Package kvtest holds what tests of kvtransfer and the packages around it
// share: engine memory as an engine owns it, and a peer that says hello and
// then nothing. Only tests import it.
package kvtest

import (
	"net"
	"sync"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/pdrouter/pdrouter/kvtransfer/shm"
	"github.com/pdrouter/pdrouter/kvtransfer/wire"
)

// EngineMemory is memory an engine owns, as the Python client leaves a
// tensor after its in-place remap: a shared mapping of a fresh memfd named
// "engine" (the name tests count mappings by). It goes at the test's end.
func EngineMemory(t testing.TB, size int) *shm.Segment {
	t.Helper()
	seg, err := shm.Create("engine", size)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = seg.Close() })
	return seg
}

// Dup is a new fd of fd's file, for a registration to take.
func Dup(t testing.TB, fd int) int {
	t.Helper()
	d, err := unix.Dup(fd)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// Addr is b's address: an engine names its memory by it.
func Addr(b []byte) uint64 { return uint64(uintptr(unsafe.Pointer(unsafe.SliceData(b)))) }

// SilentPeer is a kvproxy that completes the link handshake (advertising
// one region at 1<<30) and then acknowledges nothing; with drain it keeps
// reading what arrives, else it reads nothing more.
func SilentPeer(t testing.TB, drain bool) (addr string, stop func()) {
	hello := &wire.MemHello{Transport: "tcp", Regions: []wire.MemRegion{{ID: 1, Base: 1 << 30, Len: 1 << 20}}}
	return Peer(t, hello, func(c *wire.Conn, quit <-chan struct{}) {
		if drain {
			Drain(c)
		}
		<-quit
	})
}

// Peer is a fake kvproxy: it accepts one link, answers its MEM_HELLO with
// hello (ListenAddr filled in if empty), then runs serve until serve
// returns, which closes the link. stop closes quit and waits for that.
func Peer(t testing.TB, hello *wire.MemHello, serve func(c *wire.Conn, quit <-chan struct{})) (addr string, stop func()) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	if hello.ListenAddr == "" {
		hello.ListenAddr = ln.Addr().String()
	}
	quit, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		nc, err := ln.Accept()
		if err != nil {
			return
		}
		defer nc.Close()
		c := wire.NewConn(nc)
		if _, err := c.Read(); err != nil || c.Write(hello) != nil {
			return
		}
		serve(c, quit)
	}()
	var once sync.Once
	return ln.Addr().String(), func() { once.Do(func() { close(quit); ln.Close(); <-done }) }
}

// Drain reads and drops what arrives on c until it fails.
func Drain(c *wire.Conn) {
	for {
		m, err := c.Read()
		if err != nil {
			return
		}
		if _, ok := m.(*wire.Data); ok {
			_ = c.DiscardData()
		}
	}
}

// Start returns what the maker called name makes (a transport); one not
// built in (ucx without cgo) or not usable here skips the test.
func Start[T any](t testing.TB, name string, makers map[string]func() (T, error)) T {
	t.Helper()
	f, ok := makers[name]
	if !ok {
		t.Skipf("transport %s not built in", name)
	}
	v, err := f()
	if err != nil {
		t.Skipf("transport %s: %v", name, err)
	}
	return v
}
