package splice

// Walker reads chosen fields of one JSON value without unmarshalling or
// allocating, on the scanner Inspect uses: Object and Array call back once
// per member with the Walker at its value, which the callback reads
// (String, Int, Object, Array) or Skips. A value of a kind the reader did
// not ask for is skipped, after validation, rather than an error: a field
// of an unexpected type carries nothing to read and is no reason to fail.
// Strings are returned raw (escapes kept). The load generator reads its
// streamed replies with it.
type Walker struct{ s scanner }

// NewWalker walks b.
func NewWalker(b []byte) Walker { return Walker{scanner{b: b}} }

// Peek is the next byte that is not whitespace, 0 at the end.
func (w *Walker) Peek() byte {
	w.s.skipWS()
	if w.s.i < len(w.s.b) {
		return w.s.b[w.s.i]
	}
	return 0
}

// Skip consumes one value of any kind, validating it.
func (w *Walker) Skip() error {
	w.s.skipWS()
	return w.s.value(0)
}

// End fails unless only whitespace is left.
func (w *Walker) End() error { return w.s.end() }

// Object calls field with each member's key, the Walker at its value,
// which field must consume. Any other value is skipped.
func (w *Walker) Object(field func(key []byte) error) error {
	if w.Peek() != '{' {
		return w.Skip()
	}
	s := &w.s
	s.i++
	if w.Peek() == '}' {
		s.i++
		return nil
	}
	for {
		key, ok, err := w.String()
		if err != nil || !ok {
			return ErrBadJSON
		}
		if w.Peek() != ':' {
			return ErrBadJSON
		}
		s.i++
		if err := field(key); err != nil {
			return err
		}
		if done, err := s.next('}'); done || err != nil {
			return err
		}
	}
}

// Array calls elem with each element's index, the Walker at it, which elem
// must consume. Any other value is skipped.
func (w *Walker) Array(elem func(i int) error) error {
	if w.Peek() != '[' {
		return w.Skip()
	}
	s := &w.s
	s.i++
	if w.Peek() == ']' {
		s.i++
		return nil
	}
	for i := 0; ; i++ {
		if err := elem(i); err != nil {
			return err
		}
		if done, err := s.next(']'); done || err != nil {
			return err
		}
	}
}

// String consumes a string and returns its raw contents; any other value
// is skipped (ok false).
func (w *Walker) String() (raw []byte, ok bool, err error) {
	if w.Peek() != '"' {
		return nil, false, w.Skip()
	}
	start := w.s.i
	if err := w.s.str(); err != nil {
		return nil, false, err
	}
	return w.s.b[start+1 : w.s.i-1], true, nil
}

// Int consumes a non-negative number and returns its integer part (a
// fraction or exponent is dropped; capped near 2^40); any other value is
// skipped (ok false).
func (w *Walker) Int() (n int, ok bool, err error) {
	if c := w.Peek(); c < '0' || c > '9' {
		return 0, false, w.Skip()
	}
	start := w.s.i
	if err := w.s.number(); err != nil {
		return 0, false, err
	}
	for _, c := range w.s.b[start:w.s.i] {
		if c < '0' || c > '9' {
			break
		}
		if n < 1<<40 {
			n = n*10 + int(c-'0')
		}
	}
	return n, true, nil
}
