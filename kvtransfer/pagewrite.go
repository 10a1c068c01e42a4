package kvtransfer

import (
	"context"
	"fmt"
	"math"
)

// PageBuf is one buffer of a page write: page i of it starts at engine
// address Src+i*PageLen here and Dst+i*PageLen in the peer engine.
type PageBuf struct{ Src, Dst, PageLen uint64 }

// PagePair names one page to move: page Src of a buffer's source into page
// Dst of its destination.
type PagePair struct{ Src, Dst uint32 }

// PageWrite moves every pair of pages in every buffer: SGLang moves the same
// page indexes in each layer's K and V buffer, so this holds a
// 32-layer write of n pages in 64 buffers and n pairs instead of 64n
// triples. It means those triples buffer by buffer, each buffer's pairs in
// order.
type PageWrite struct {
	Bufs  []PageBuf
	Pairs []PagePair
}

// MaxPageWrite bounds the ranges one page write names (buffers × pairs):
// 128k tokens of 16-token pages in 160 buffers (80 layers) fit.
const MaxPageWrite = 1 << 21

// Count is the number of ranges w names.
func (w *PageWrite) Count() uint64 { return uint64(len(w.Bufs)) * uint64(len(w.Pairs)) }

// Bytes is the total w moves (saturating: Check refuses what overflows).
func (w *PageWrite) Bytes() uint64 {
	var total uint64
	for _, b := range w.Bufs {
		total += min(b.PageLen, maxMemoryRegion)
	}
	return total * uint64(len(w.Pairs))
}

// span returns the lowest and one past the highest page index each side
// of w names.
func (w *PageWrite) span() (srcLo, srcHi, dstLo, dstHi uint64) {
	srcLo, dstLo = math.MaxUint32, math.MaxUint32
	for _, p := range w.Pairs {
		srcLo, srcHi = min(srcLo, uint64(p.Src)), max(srcHi, uint64(p.Src)+1)
		dstLo, dstHi = min(dstLo, uint64(p.Dst)), max(dstHi, uint64(p.Dst)+1)
	}
	return
}

// Check refuses a write too big to expand or whose ranges overflow.
func (w *PageWrite) Check() error {
	if w.Count() > MaxPageWrite {
		return fmt.Errorf("page write of %d buffers × %d pages: at most %d ranges", len(w.Bufs), len(w.Pairs), MaxPageWrite)
	}
	if len(w.Pairs) == 0 {
		return nil
	}
	_, srcHi, _, dstHi := w.span()
	for i, b := range w.Bufs {
		// Pages past the largest region cannot be registered; this also
		// keeps index × length from overflowing.
		if b.PageLen == 0 || b.PageLen > maxMemoryRegion || max(srcHi, dstHi) > maxMemoryRegion/b.PageLen ||
			b.Src+srcHi*b.PageLen < b.Src || b.Dst+dstHi*b.PageLen < b.Dst {
			return fmt.Errorf("page write buffer %d: pages of %d bytes up to page %d from %#x/%#x overflow", i, b.PageLen, max(srcHi, dstHi), b.Src, b.Dst)
		}
	}
	return nil
}

// pageRun is count pages following Src and Dst on both sides.
type pageRun struct{ src, dst, count uint64 }

// runs merges pairs that follow each other on both sides (a contiguous
// page list becomes one run per buffer).
func (w *PageWrite) runs() []pageRun {
	var rs []pageRun
	for _, p := range w.Pairs {
		s, d := uint64(p.Src), uint64(p.Dst)
		if n := len(rs); n > 0 && rs[n-1].src+rs[n-1].count == s && rs[n-1].dst+rs[n-1].count == d {
			rs[n-1].count++
			continue
		}
		rs = append(rs, pageRun{s, d, 1})
	}
	return rs
}

// WritePages is Write for a page write: GPU memory moves without expanding
// it into triples.
func (s *MemorySession) WritePages(ctx context.Context, peer string, w *PageWrite) error {
	return s.writePages(ctx, peer, w, nil, func(ctx context.Context) (*memLink, error) { return s.p.link(ctx, peer) })
}

// writePages moves w plus the ranges extra into the engine behind the link
// link returns.
func (s *MemorySession) writePages(ctx context.Context, peer string, w *PageWrite, extra []Triple, link func(context.Context) (*memLink, error)) error {
	if err := w.Check(); err != nil {
		return fmt.Errorf("write to %s: %w", peer, err)
	}
	deadline := writeDeadline(s.p.cfg.WriteTimeout, append([]Triple{{Len: w.Bytes()}}, extra...))
	return s.write(ctx, peer, deadline, func(ctx context.Context) error {
		l, err := link(ctx)
		if err != nil {
			return err
		}
		ts := w.mergedTriples()
		if len(ts) > 0 && s.p.gpu.holds(ts[:1]) {
			if err := s.p.gpu.writePages(ctx, s.p, l, w, ts); err != nil {
				return err
			}
			ts = nil
		}
		return s.p.writeLink(ctx, l, append(ts, extra...))
	})
}

// mergedTriples lists w's ranges with pages that follow each other on both
// sides merged: a contiguous page list is one triple per buffer.
func (w *PageWrite) mergedTriples() []Triple {
	rs := w.runs()
	ts := make([]Triple, 0, len(w.Bufs)*len(rs))
	for _, b := range w.Bufs {
		for _, r := range rs {
			ts = append(ts, Triple{Src: b.Src + r.src*b.PageLen, Dst: b.Dst + r.dst*b.PageLen, Len: r.count * b.PageLen})
		}
	}
	return ts
}
