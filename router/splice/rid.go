package splice

import (
	"encoding/hex"
	"math/rand/v2"
	"strconv"
)

// RIDLen is the length of a rid the router makes up: 32 hex digits, the
// shape of SGLang's own (uuid4().hex).
const RIDLen = 32

// SetNewRID sets a fresh "rid" on b, which has none, and returns its JSON
// value (quotes included) inside b.
func SetNewRID(b *Body) []byte {
	var val [RIDLen + 2]byte
	var raw [RIDLen / 2]byte
	for i := 0; i < len(raw); i += 8 {
		v := rand.Uint64()
		for j := range 8 {
			raw[i+j] = byte(v >> (8 * j))
		}
	}
	val[0] = '"'
	hex.Encode(val[1:1+RIDLen], raw[:])
	val[len(val)-1] = '"'
	return b.Set("rid", Span{}, val[:])
}

// RIDs calls fn with each request id a rid value names, as SGLang expands
// it: a string is itself, or for a batch of n prompts "<rid>_0".."<rid>_n-1";
// an array names each string element. Values are JSON strings, quotes and
// escapes kept, ready to be sent back. Other values name nothing. At most
// limit ids are named.
func RIDs(val []byte, batch, limit int, fn func(rid []byte)) {
	if len(val) < 2 {
		return
	}
	switch val[0] {
	case '"':
		if batch <= 1 {
			fn(val)
			return
		}
		buf := make([]byte, 0, len(val)+8)
		for i := range min(batch, limit) {
			buf = append(buf[:0], val[:len(val)-1]...)
			buf = append(buf, '_')
			buf = strconv.AppendInt(buf, int64(i), 10)
			fn(append(buf, '"'))
		}
	case '[':
		s := scanner{b: val, i: 1}
		for n := 0; n < limit; {
			s.skipWS()
			if s.i >= len(s.b) || s.b[s.i] == ']' {
				return
			}
			start := s.i
			if s.value(1) != nil {
				return
			}
			if s.b[start] == '"' {
				fn(s.b[start:s.i])
				n++
			}
			s.skipWS()
			if s.i < len(s.b) && s.b[s.i] == ',' {
				s.i++
			}
		}
	}
}

// SuffixRID returns a rid value with suffix appended to the id it names: a
// string gets it before its closing quote, an array on each string element
// (escapes kept as they are). Any other value names no id: nil.
func SuffixRID(val []byte, suffix string) []byte {
	if len(val) < 2 {
		return nil
	}
	switch val[0] {
	case '"':
		out := make([]byte, 0, len(val)+len(suffix))
		out = append(out, val[:len(val)-1]...)
		return append(append(out, suffix...), '"')
	case '[':
		out := make([]byte, 0, len(val)+8*len(suffix))
		s := scanner{b: val, i: 1}
		last := 0
		for {
			s.skipWS()
			if s.i >= len(s.b) || s.b[s.i] == ']' {
				return append(out, val[last:]...)
			}
			start := s.i
			if s.value(1) != nil {
				return nil
			}
			if s.b[start] == '"' {
				out = append(out, val[last:s.i-1]...)
				out = append(append(out, suffix...), '"')
				last = s.i
			}
			s.skipWS()
			if s.i < len(s.b) && s.b[s.i] == ',' {
				s.i++
			}
		}
	}
	return nil
}
