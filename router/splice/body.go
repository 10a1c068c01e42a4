package splice

import "bytes"

// Body is an upstream request body held as segments: runs of the client's
// bytes, never copied, with the router's edits (bootstrap fields, rid, DP
// ranks) between them. A large body then costs its size once, in the
// buffer it was read into, however many legs and retries send it.
//
// Reset it with the client's body, Set the fields, then write Segments.
// The client's bytes must stay unchanged while the body is in use; a Body
// is not safe for concurrent edits, but its segments may be read by
// several legs at once.
type Body struct {
	src     []byte
	closing int  // index of src's closing brace
	empty   bool // src is {}: the first new member needs no comma
	// edits in body order: replacements by position, then the new members
	// (all at the closing brace) in the order they were set.
	edits [maxEdits]edit
	n     int
	size  int
	// vals holds the edits' bytes ("\"key\":value" for new members): its
	// own small array first, a heap buffer beyond. Edits point into it by
	// offset, and growing it never moves the bytes Set has returned.
	vals  []byte
	space [192]byte
}

// maxEdits is how many fields one body may have set: the three bootstrap
// fields, the rid, two DP rank fields, and room for more.
const maxEdits = 8

// edit replaces src[start:end] (start == end: inserts) with vals[v0:v1].
type edit struct {
	start, end int32
	v0, v1     int32
	member     bool // a new member: a comma goes before it unless it opens an empty object
}

// Reset makes b the client's body src, unedited.
func (b *Body) Reset(src []byte) {
	b.src = src
	b.closing = lastBrace(src)
	b.empty = isEmptyObject(src, b.closing)
	b.n = 0
	b.size = len(src)
	b.vals = b.space[:0]
}

// Reuse is Reset for a pooled body: it keeps the heap buffer an earlier
// use's edits outgrew the inline space into (up to maxKeptVals), so that a
// long value (a vLLM prefill's kv_transfer_params) costs no allocation
// once the pool is warm. What Set returned before is overwritten.
func (b *Body) Reuse(src []byte) {
	vals := b.vals
	b.Reset(src)
	if c := cap(vals); c > len(b.space) && c <= maxKeptVals { // beyond space: a heap buffer
		b.vals = vals[:0]
	}
}

// maxKeptVals bounds the buffer Reuse keeps: a huge edit is not worth
// holding memory for.
const maxKeptVals = 16 << 10

// Set gives the top-level key the JSON value val: in place of the client's
// value at at when at.OK() (key order survives), else as a new member
// before the closing brace. val is copied; the copy inside b, valid while b
// is, is returned. It panics past maxEdits fields: a router bug, not input.
func (b *Body) Set(key string, at Span, val []byte) []byte {
	if b.n == maxEdits {
		panic("splice: too many fields set on one body")
	}
	e := edit{start: at.Start, end: at.End, v0: int32(len(b.vals))}
	if !at.OK() {
		e = edit{start: int32(b.closing), end: int32(b.closing), v0: e.v0, member: true}
		if !b.empty || b.hasMember() {
			b.size++ // the comma
		}
		b.vals = append(b.vals, '"')
		b.vals = append(b.vals, key...)
		b.vals = append(b.vals, '"', ':')
	}
	valAt := len(b.vals)
	b.vals = append(b.vals, val...)
	e.v1 = int32(len(b.vals))
	b.size += int(e.v1-e.v0) - int(e.end-e.start)
	// Insert in order; a member goes after every edit at its position.
	i := b.n
	for i > 0 && b.edits[i-1].start > e.start {
		b.edits[i] = b.edits[i-1]
		i--
	}
	b.edits[i] = e
	b.n++
	return b.vals[valAt:len(b.vals):len(b.vals)]
}

func (b *Body) hasMember() bool {
	return b.n > 0 && b.edits[b.n-1].member
}

var comma = []byte{','}

// Segments yields the body's bytes in order (for seg := range b.Segments);
// their total is Len. It only reads b.
func (b *Body) Segments(yield func([]byte) bool) {
	pos := int32(0)
	members := 0
	for _, e := range b.edits[:b.n] {
		if e.start > pos && !yield(b.src[pos:e.start]) {
			return
		}
		if e.member {
			if (!b.empty || members > 0) && !yield(comma) {
				return
			}
			members++
		}
		if !yield(b.vals[e.v0:e.v1]) {
			return
		}
		pos = e.end
	}
	if int(pos) < len(b.src) {
		yield(b.src[pos:])
	}
}

// Len is the body's size in bytes.
func (b *Body) Len() int { return b.size }

// AppendTo appends the whole body to dst (tests, and callers that need it
// in one piece).
func (b *Body) AppendTo(dst []byte) []byte {
	for s := range b.Segments {
		dst = append(dst, s...)
	}
	return dst
}

// Detach gives b a copy of the client's bytes, for a body that must
// outlive the buffer it was read into.
func (b *Body) Detach() { b.src = bytes.Clone(b.src) }

// CopyTo makes dst a copy of b, edits included, that is edited on its own:
// PD's two legs share the bootstrap fields and rid but, with DP ranks,
// differ in the rank fields.
func (b *Body) CopyTo(dst *Body) {
	dst.Reset(b.src)
	dst.vals = append(dst.vals, b.vals...)
	dst.edits, dst.n, dst.size = b.edits, b.n, b.size
}
