package kvtransfer

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/pdrouter/pdrouter/cuda"
)

// Triples lists w's ranges: each buffer's pairs in order (what a page
// write means).
func (w *PageWrite) Triples() []Triple {
	ts := make([]Triple, 0, w.Count())
	for _, b := range w.Bufs {
		for _, p := range w.Pairs {
			ts = append(ts, Triple{Src: b.Src + uint64(p.Src)*b.PageLen, Dst: b.Dst + uint64(p.Dst)*b.PageLen, Len: b.PageLen})
		}
	}
	return ts
}

func TestPageWriteExpands(t *testing.T) {
	w := PageWrite{
		Bufs:  []PageBuf{{Src: 1000, Dst: 5000, PageLen: 10}, {Src: 2000, Dst: 6000, PageLen: 4}},
		Pairs: []PagePair{{Src: 0, Dst: 2}, {Src: 1, Dst: 3}, {Src: 5, Dst: 0}},
	}
	want := []Triple{
		{1000, 5020, 10}, {1010, 5030, 10}, {1050, 5000, 10},
		{2000, 6008, 4}, {2004, 6012, 4}, {2020, 6000, 4},
	}
	if got := w.Triples(); !slices.Equal(got, want) || w.Count() != 6 || w.Bytes() != 42 {
		t.Fatalf("triples %v count %d bytes %d", got, w.Count(), w.Bytes())
	}
	if got := w.runs(); !slices.Equal(got, []pageRun{{0, 2, 2}, {5, 0, 1}}) {
		t.Fatalf("runs %v", got)
	}
	if err := w.Check(); err != nil {
		t.Fatal(err)
	}
}

func TestPageWriteCheck(t *testing.T) {
	for _, tc := range []struct {
		name string
		w    PageWrite
		want string
	}{
		{"zero page length", PageWrite{Bufs: []PageBuf{{PageLen: 0}}, Pairs: []PagePair{{}}}, "overflow"},
		{"index times length overflows", PageWrite{Bufs: []PageBuf{{PageLen: 1 << 33}}, Pairs: []PagePair{{Dst: 1<<32 - 1}}}, "overflow"},
		{"address wraps", PageWrite{Bufs: []PageBuf{{Src: 1<<64 - 4096, PageLen: 4096}}, Pairs: []PagePair{{Src: 1}}}, "overflow"},
		{"too many ranges", PageWrite{Bufs: make([]PageBuf, 2), Pairs: make([]PagePair, MaxPageWrite/2+1)}, "at most"},
	} {
		if err := tc.w.Check(); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want %q", tc.name, err, tc.want)
		}
	}
}

// A page write resolves each buffer once and lists the same device runs as
// its triples would, merged where pages follow on both sides.
func TestGPUPageRunsMatchTriples(t *testing.T) {
	const pg = 32 << 10
	w := &PageWrite{
		Bufs:  []PageBuf{{Src: 0x10000000, Dst: 0x30000000, PageLen: pg}, {Src: 0x20000000, Dst: 0x40000000, PageLen: pg / 2}},
		Pairs: []PagePair{{Src: 0, Dst: 1}, {Src: 1, Dst: 2}, {Src: 4, Dst: 8}, {Src: 6, Dst: 10}},
	}
	g, l := fakeGPU()
	var got []cuda.Run
	srcs, err := g.pageRuns(context.Background(), l, g.regions[0].dev, w, w.runs(), nil, func(rs []cuda.Run) error { got = append(got, rs...); return nil })
	for _, r := range srcs {
		r.use.RUnlock()
	}
	if err != nil || len(srcs) != 2 {
		t.Fatalf("srcs %d, %v", len(srcs), err)
	}
	want, _, _, err := g.resolve(context.Background(), l, g.regions[0].dev, w.Triples(), nil, nil)
	g.regions[0].use.RUnlock()
	g.regions[1].use.RUnlock()
	if err != nil || !slices.Equal(got, want) || len(got) != 6 {
		t.Fatalf("page runs %x, triples' runs %x (%v)", got, want, err)
	}
}

// Runs come out in parts of at most gpuChunk, so big writes overlap
// listing with copying.
func TestGPUPageRunsInParts(t *testing.T) {
	w := &PageWrite{Bufs: []PageBuf{{Src: 0x10000000, Dst: 0x30000000, PageLen: 4096}, {Src: 0x10000000, Dst: 0x30000000, PageLen: 2048}}}
	for i := range uint32(gpuChunk) {
		w.Pairs = append(w.Pairs, PagePair{Src: 2 * i, Dst: 2 * i})
	}
	g, l := fakeGPU()
	var parts []int
	srcs, err := g.pageRuns(context.Background(), l, g.regions[0].dev, w, w.runs(), nil, func(rs []cuda.Run) error { parts = append(parts, len(rs)); return nil })
	for _, r := range srcs {
		r.use.RUnlock()
	}
	if err != nil || !slices.Equal(parts, []int{gpuChunk, gpuChunk}) {
		t.Fatalf("parts %v, %v", parts, err)
	}
}

func TestGPUPageRunsReject(t *testing.T) {
	for _, tc := range []struct {
		name string
		b    PageBuf
		p    PagePair
		want string
	}{
		{"source page past its region", PageBuf{Src: 0x10000000, Dst: 0x30000000, PageLen: 1 << 20}, PagePair{Src: 64}, "buffer 0: source"},
		{"destination page past its region", PageBuf{Src: 0x10000000, Dst: 0x30000000, PageLen: 1 << 20}, PagePair{Dst: 64}, "buffer 0: refresh peer regions: link gone"},
		{"host destination", PageBuf{Src: 0x10000000, Dst: 0x50000000, PageLen: 4096}, PagePair{}, "staged path"},
	} {
		g, l := fakeGPU()
		l.closed, l.err = true, errors.New("link gone") // an unknown destination's refresh fails
		w := &PageWrite{Bufs: []PageBuf{tc.b}, Pairs: []PagePair{tc.p}}
		srcs, err := g.pageRuns(context.Background(), l, g.regions[0].dev, w, w.runs(), nil, func([]cuda.Run) error { return nil })
		for _, r := range srcs {
			r.use.RUnlock()
		}
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want %q", tc.name, err, tc.want)
		}
	}
}

// BenchmarkGPUPageRuns is BenchmarkGPUResolveScattered's write as a page
// write: 4k tokens of every other page in 32 buffers.
func BenchmarkGPUPageRuns(b *testing.B) {
	g, l := fakeGPU()
	w := &PageWrite{Bufs: make([]PageBuf, 32)}
	for i := range w.Bufs {
		w.Bufs[i] = PageBuf{Src: 0x10000000, Dst: 0x30000000, PageLen: 32 << 10}
	}
	for i := range uint32(512) {
		w.Pairs = append(w.Pairs, PagePair{Src: 2 * i, Dst: 2 * i})
	}
	b.ResetTimer()
	for range b.N {
		srcs, err := g.pageRuns(context.Background(), l, g.regions[0].dev, w, w.runs(), nil, func([]cuda.Run) error { return nil })
		for _, r := range srcs {
			r.use.RUnlock()
		}
		if err != nil {
			b.Fatal(err)
		}
	}
}

func TestMergedTriples(t *testing.T) {
	w := PageWrite{Bufs: []PageBuf{{Src: 0x1000, Dst: 0x9000, PageLen: 256}, {Src: 0x2000, Dst: 0xa000, PageLen: 256}},
		Pairs: []PagePair{{1, 10}, {2, 11}, {3, 12}, {7, 13}, {8, 14}}}
	ts := w.mergedTriples()
	// Two merged runs ([1..3]→[10..12], [7..8]→[13..14]) × 2 buffers.
	want := []Triple{
		{Src: 0x1000 + 256, Dst: 0x9000 + 10*256, Len: 3 * 256}, {Src: 0x1000 + 7*256, Dst: 0x9000 + 13*256, Len: 2 * 256},
		{Src: 0x2000 + 256, Dst: 0xa000 + 10*256, Len: 3 * 256}, {Src: 0x2000 + 7*256, Dst: 0xa000 + 13*256, Len: 2 * 256},
	}
	if !slices.Equal(ts, want) {
		t.Fatalf("got %+v\nwant %+v", ts, want)
	}
	// The same bytes as the expanded list.
	var a, b uint64
	for _, x := range ts {
		a += x.Len
	}
	for _, x := range w.Triples() {
		b += x.Len
	}
	if a != b {
		t.Fatalf("merged %d bytes, expanded %d", a, b)
	}
}
