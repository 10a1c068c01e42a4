package splice

import (
	"bytes"
	"slices"
)

// Body is an upstream request body held as segments: runs of the client's
// bytes, never copied, with the router's edits (bootstrap fields, rid)
// between them. A large body then costs its size once, in the buffer it
// was read into, however many legs and retries send it.
//
// Reset it with the client's body, Set the fields, then write Segments.
// The client's bytes must stay unchanged while the body is in use; a Body
// is not safe for concurrent edits, but its segments may be written by
// several legs at once.
type Body struct {
	src   []byte
	edits [maxEdits]edit
	n     int
	// vals holds the edits' bytes (",\"key\":value" for added members): its
	// own small array first, a heap buffer beyond. Growing it never moves
	// the bytes of earlier edits, which the returned values point into.
	vals  []byte
	space [256]byte

	// The segments are rebuilt by every edit, so that legs may read them
	// at once.
	segs  [3*maxEdits + 1][]byte // per edit: the client's run, a comma, the value
	nsegs int
	size  int
}

// maxEdits is how many fields one body may have set: the three bootstrap
// fields, the rid, and room for a few more.
const maxEdits = 8

// edit replaces src[start:end] with val (start == end: inserts); member
// edits insert before the closing brace and need a separating comma.
type edit struct {
	start, end int
	val        []byte
	member     bool
}

// Reset makes b the client's body src, unedited.
func (b *Body) Reset(src []byte) {
	b.src = src
	b.n = 0
	b.vals = b.space[:0]
	b.build()
}

// Set gives the top-level key the JSON value val: in place of the client's
// value at at when at.OK() (key order survives), else as a new member
// before the closing brace. val is copied; the copy inside b, valid while b
// is, is returned. It panics past maxEdits fields: a router bug, not input.
func (b *Body) Set(key string, at Span, val []byte) []byte {
	if b.n == maxEdits {
		panic("splice: too many fields set on one body")
	}
	e := &b.edits[b.n]
	b.n++
	defer b.build()
	start := len(b.vals)
	if at.OK() {
		b.vals = append(b.vals, val...)
		*e = edit{start: int(at.Start), end: int(at.End), val: b.vals[start:]}
		return e.val
	}
	closing := lastBrace(b.src)
	b.vals = append(b.vals, '"')
	b.vals = append(b.vals, key...)
	b.vals = append(b.vals, '"', ':')
	b.vals = append(b.vals, val...)
	*e = edit{start: closing, end: closing, val: b.vals[start:], member: true}
	return e.val[len(key)+3:]
}

// Detach gives b a copy of the client's bytes, for a body that must
// outlive the buffer it was read into.
func (b *Body) Detach() {
	b.src = bytes.Clone(b.src)
	b.build()
}

// Segments are the body's bytes in order; their total is Len.
func (b *Body) Segments() [][]byte { return b.segs[:b.nsegs] }

// Len is the body's size in bytes.
func (b *Body) Len() int { return b.size }

// AppendTo appends the whole body to dst (tests, and callers that need it
// in one piece).
func (b *Body) AppendTo(dst []byte) []byte {
	for _, s := range b.Segments() {
		dst = append(dst, s...)
	}
	return dst
}

var comma = []byte{','}

func (b *Body) build() {
	edits := b.edits[:b.n]
	// Replacements in body order; members (all at the closing brace) after
	// them, in the order they were set.
	slices.SortStableFunc(edits, func(x, y edit) int { return x.start - y.start })
	b.nsegs, b.size = 0, 0
	pos := 0
	empty := isEmptyObject(b.src, lastBrace(b.src))
	for _, e := range edits {
		b.add(b.src[pos:e.start])
		if e.member {
			if !empty {
				b.add(comma)
			}
			empty = false
		}
		b.add(e.val)
		pos = e.end
	}
	b.add(b.src[pos:])
}

func (b *Body) add(s []byte) {
	if len(s) == 0 {
		return
	}
	b.segs[b.nsegs] = s
	b.nsegs++
	b.size += len(s)
}
