package control

import (
	"bufio"
	"context"
	"encoding/binary"
	"io"
	"net"
	"runtime"
	"strings"
	"testing"
	"time"
)

// smallWritePair is two tcp kvproxies whose link is up (the decode side
// dialled it: a write that dials waits on the peer) and a 64-byte write
// from p's engine into d's.
func smallWritePair(t *testing.T) (p, d *memProxy, ts []Triple, src, dst []byte) {
	p, d = startMemProxy(t, "tcp"), startMemProxy(t, "tcp")
	ctx := context.Background()
	src, srcFd := engineMem(t, 4096)
	dst, dstFd := engineMem(t, 4096)
	if err := p.cl.RegisterMemory(ctx, vaddr(src), 4096, srcFd); err != nil {
		t.Fatal(err)
	}
	if err := d.cl.RegisterMemory(ctx, vaddr(dst), 4096, dstFd); err != nil {
		t.Fatal(err)
	}
	s := d.plane.NewSession()
	t.Cleanup(func() { s.Close() })
	if err := s.Probe(ctx, p.plane.PeerAddr()); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the link", func() bool { return p.plane.Links() == 1 })
	return p, d, []Triple{{Src: vaddr(src), Dst: vaddr(dst) + 64, Len: 64}}, src, dst
}

// goroutinesIn counts the goroutines whose stack holds fn.
func goroutinesIn(fn string) int {
	buf := make([]byte, 1<<20)
	return strings.Count(string(buf[:runtime.Stack(buf, true)]), fn)
}

// TestSmallTCPWritesNeedNoWorker: the read loop starts a small tcp write
// itself and the link's reader answers it (issue 28: a worker to hand the
// write to, and the hop back to it with the answer, cost more than the
// write), so a connection making such writes starts no worker goroutine.
func TestSmallTCPWritesNeedNoWorker(t *testing.T) {
	p, d, ts, src, dst := smallWritePair(t)
	ctx := context.Background()
	// Once the link is quiet (the probe's answer may still hold its
	// socket, and a write finding it busy goes to a worker), a new
	// connection writes.
	if err := p.cl.Write(ctx, d.plane.PeerAddr(), ts); err != nil {
		t.Fatal(err)
	}
	cl, err := Dial(p.sock)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	workers := goroutinesIn(".(*conn).work(")
	for i := range 20 {
		src[0] = byte(i + 1)
		if err := cl.Write(ctx, d.plane.PeerAddr(), ts); err != nil {
			t.Fatal(err)
		}
		if dst[64] != byte(i+1) {
			t.Fatalf("write %d did not land", i)
		}
	}
	if n := goroutinesIn(".(*conn).work(") - workers; n != 0 {
		t.Fatalf("%d workers for small writes", n)
	}
}

// TestRepliesToAnEngineThatDoesNotReadBlockNoLink: an engine that sends
// small writes and reads none of their answers fills its socket; the
// answers then wait for it, and the link's reader, which answers them, goes
// on serving everyone else's writes.
func TestRepliesToAnEngineThatDoesNotReadBlockNoLink(t *testing.T) {
	p, d, ts, _, _ := smallWritePair(t)
	slow, err := net.Dial("unix", p.sock)
	if err != nil {
		t.Fatal(err)
	}
	defer slow.Close()
	const writes = 3000 // answers enough to fill a unix socket many times
	sent := make(chan error, 1)
	go func() {
		w := bufio.NewWriter(slow)
		for i := range writes {
			if _, err := w.Write(EncodeRequest(&Request{Op: OpWrite, ID: uint64(i + 1), Peer: d.plane.PeerAddr(), Triples: ts})); err != nil {
				sent <- err
				return
			}
		}
		sent <- w.Flush()
	}()
	select {
	case err := <-sent:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("kvproxy stopped reading the engine's requests")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := p.cl.Write(ctx, d.plane.PeerAddr(), ts); err != nil {
		t.Fatalf("another engine's write while the link's answers wait: %v", err)
	}
	r := bufio.NewReader(slow)
	seen := make([]bool, writes+1)
	for range writes {
		var n [4]byte
		if _, err := io.ReadFull(r, n[:]); err != nil {
			t.Fatal(err)
		}
		body := make([]byte, binary.LittleEndian.Uint32(n[:]))
		if _, err := io.ReadFull(r, body); err != nil {
			t.Fatal(err)
		}
		rep, err := DecodeReply(body)
		if err != nil || rep.Err != "" || rep.ID == 0 || rep.ID > writes || seen[rep.ID] {
			t.Fatalf("answer %+v %v", rep, err)
		}
		seen[rep.ID] = true
	}
}
