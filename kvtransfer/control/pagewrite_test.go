package control

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"reflect"
	"strings"
	"testing"

	"github.com/pdrouter/pdrouter/kvtransfer"
	"github.com/pdrouter/pdrouter/kvtransfer/wire"
)

func TestWritePagesFrameIsCompact(t *testing.T) {
	// 64 buffers and 2048 pairs (32k tokens, every other page) in 17 KB,
	// against 3 MB of triples.
	big := kvtransfer.PageWrite{Bufs: make([]kvtransfer.PageBuf, 64), Pairs: make([]kvtransfer.PagePair, 2048)}
	if n := len(EncodeRequest(&Request{Op: OpWritePages, Peer: "h:1", PageWrite: big})); n > 18<<10 {
		t.Fatalf("page write frame of %d bytes", n)
	}
}

func TestHelloFeatures(t *testing.T) {
	rep := &Reply{Op: OpHello, ID: 1, PeerAddr: "h:1", Transport: "ucx", Features: FeatureWritePages}
	body, _, _ := splitFrame(EncodeReply(rep))
	if got, err := DecodeReply(body); err != nil || !reflect.DeepEqual(got, rep) {
		t.Fatalf("%+v %v", got, err)
	}
	// An older kvproxy's Hello reply ends after the transport: no features.
	old := body[:len(body)-4]
	if got, err := DecodeReply(old); err != nil || got.Features != 0 || got.Transport != "ucx" {
		t.Fatalf("old hello: %+v %v", got, err)
	}
}

func TestDecodeRejectsBadPageWrites(t *testing.T) {
	enc := func(nb, np int) []byte {
		return EncodeRequest(&Request{Op: OpWritePages, Peer: "p", PageWrite: kvtransfer.PageWrite{
			Bufs: make([]kvtransfer.PageBuf, nb), Pairs: make([]kvtransfer.PagePair, np)}})[4:]
	}
	const bufCount = 9 + 4 + 1 // op, id, peer
	bufs := enc(1, 1)
	binary.LittleEndian.PutUint32(bufs[bufCount:], 1000)
	pairs := enc(1, 1)
	binary.LittleEndian.PutUint32(pairs[bufCount+4+24:], 1000)
	hugeBufs := enc(0, 0)
	binary.LittleEndian.PutUint32(hugeBufs[bufCount:], 1<<31)
	// More ranges than a page write may name, each count within its bytes.
	product := enc(2, kvtransfer.MaxPageWrite/2+1)
	for name, b := range map[string][]byte{"buffers overrun": bufs, "pairs overrun": pairs, "huge buffer count": hugeBufs,
		"too many ranges": product, "truncated": enc(1, 1)[:bufCount+10], "trailing": append(enc(1, 1), 0)} {
		if _, err := DecodeRequest(b); !errors.Is(err, wire.ErrMalformed) {
			t.Errorf("%s: %v, want ErrMalformed", name, err)
		}
	}
}

// A page write between engines' host memory (the fallback: kvproxy expands
// it into triples) lands page for page, buffer by buffer.
func TestWritePagesThroughControl(t *testing.T) {
	p, d := startMemProxy(t, "tcp"), startMemProxy(t, "tcp")
	ctx := context.Background()
	peer, _, err := d.cl.Hello(ctx)
	if err != nil {
		t.Fatal(err)
	}
	const pg, pages = 4096, 8
	var srcs, dsts [2][]byte
	for b := range srcs {
		var fd int
		srcs[b], fd = engineMem(t, pg*pages)
		for i := range srcs[b] {
			srcs[b][i] = byte(i/pg*16 + b + 1)
		}
		if err := p.cl.RegisterMemory(ctx, vaddr(srcs[b]), pg*pages, fd); err != nil {
			t.Fatal(err)
		}
		dsts[b], fd = engineMem(t, pg*pages)
		if err := d.cl.RegisterMemory(ctx, vaddr(dsts[b]), pg*pages, fd); err != nil {
			t.Fatal(err)
		}
	}
	// Page len 4096 in buffer 0, 2048 in buffer 1 (page i starts at i*2048).
	w := kvtransfer.PageWrite{
		Bufs:  []kvtransfer.PageBuf{{Src: vaddr(srcs[0]), Dst: vaddr(dsts[0]), PageLen: pg}, {Src: vaddr(srcs[1]), Dst: vaddr(dsts[1]), PageLen: pg / 2}},
		Pairs: []kvtransfer.PagePair{{Src: 0, Dst: 1}, {Src: 2, Dst: 3}, {Src: 6, Dst: 7}},
	}
	if err := p.cl.WritePages(ctx, peer, w); err != nil {
		t.Fatal(err)
	}
	for b, buf := range w.Bufs {
		n := buf.PageLen
		want := make([]byte, pg*pages)
		for _, pr := range w.Pairs {
			copy(want[uint64(pr.Dst)*n:], srcs[b][uint64(pr.Src)*n:uint64(pr.Src+1)*n])
		}
		if !bytes.Equal(dsts[b], want) {
			t.Fatalf("buffer %d: pages did not land where the pairs said", b)
		}
	}
	// A page past the registered region fails and names why.
	w.Pairs = []kvtransfer.PagePair{{Src: pages, Dst: 0}}
	if err := p.cl.WritePages(ctx, peer, w); err == nil || !strings.Contains(err.Error(), "not registered") {
		t.Fatalf("page past the region: %v", err)
	}
	// Indexes whose byte offset overflows are refused before anything moves.
	w.Pairs = []kvtransfer.PagePair{{Src: 1<<32 - 1, Dst: 0}}
	w.Bufs[0].PageLen = 1 << 40
	if err := p.cl.WritePages(ctx, peer, w); err == nil || !strings.Contains(err.Error(), "overflow") {
		t.Fatalf("overflowing page write: %v", err)
	}
	// Nothing to move is fine.
	if err := p.cl.WritePages(ctx, peer, kvtransfer.PageWrite{Bufs: w.Bufs}); err != nil {
		t.Fatal(err)
	}
}
