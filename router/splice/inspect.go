// Package splice inspects and edits request bodies without unmarshalling
// them: one validating pass records where the fields routing needs are, and
// the bootstrap fields are spliced into the bytes, so unknown fields, key
// order and number spellings reach the workers exactly as the client sent
// them.
package splice

import (
	"encoding/binary"
	"errors"
	"math/bits"
	"unsafe"
)

var (
	ErrNotObject = errors.New("request body must be a JSON object")
	ErrBadJSON   = errors.New("request body is not valid JSON")
	ErrTooDeep   = errors.New("request body nests too deeply")
)

// maxDepth bounds nesting so a hostile body cannot blow the scanner's stack.
const maxDepth = 512

// Span is a half-open byte range [Start, End) in the body; End == 0 means absent.
type Span struct{ Start, End int32 }

func (s Span) OK() bool { return s.End > 0 }

// Info is what routing reads from a request body.
type Info struct {
	Stream        bool
	ReturnLogprob bool // /generate return_logprob:true
	Logprobs      bool // OpenAI logprobs present and not false/null
	HasRanks      bool // a DP rank field is present (FindRanks locates them)
	N             int64
	Text          Span // /generate "text" value (string or array)
	Prompt        Span // /v1/completions "prompt" value
	InputIDs      Span // /generate "input_ids" value
	Messages      Span // /v1/chat/completions "messages" value
	Query         Span // /v1/rerank "query" value
	Model         Span // "model" value
	RID           Span // "rid" value: SGLang's request id, which aborts name
	// values of the client's own bootstrap fields, to be overwritten, in
	// bootstrapKeys order
	Bootstrap [3]Span
}

var bootstrapKeys = [3]string{"bootstrap_host", "bootstrap_port", "bootstrap_room"}

// Inspect validates that body is exactly one JSON object and fills info
// with what routing needs.
func Inspect(body []byte, info *Info) error {
	*info = Info{N: 1}
	s := scanner{b: body}
	s.skipWS()
	if s.i >= len(s.b) || s.b[s.i] != '{' {
		if s.i < len(s.b) && s.value(0) == nil {
			return ErrNotObject
		}
		return ErrBadJSON
	}
	if err := s.object(0, info); err != nil {
		return err
	}
	return s.end()
}

func (info *Info) record(key []byte, valStart, valEnd int, b []byte) {
	val := b[valStart:valEnd]
	sp := Span{int32(valStart), int32(valEnd)}
	// A key with escapes never matches these plain names, which is what a
	// decoder would do too only for unescaped spellings; escaped field names
	// are vanishingly rare and routing then just ignores them.
	switch bstr(key) {
	case "stream":
		info.Stream = bstr(val) == "true"
	case "return_logprob":
		info.ReturnLogprob = bstr(val) == "true"
	case "logprobs":
		info.Logprobs = bstr(val) != "false" && bstr(val) != "null"
	case "n":
		info.N = parseSmallInt(val)
	case "text":
		info.Text = sp
	case "prompt":
		info.Prompt = sp
	case "input_ids":
		info.InputIDs = sp
	case "messages":
		info.Messages = sp
	case "query":
		info.Query = sp
	case "model":
		info.Model = sp
	case "rid":
		info.RID = sp
	case "bootstrap_host", "bootstrap_port", "bootstrap_room":
		for i, k := range bootstrapKeys {
			if bstr(key) == k {
				info.Bootstrap[i] = sp
			}
		}
	case "data_parallel_rank", "routed_dp_rank", "disagg_prefill_dp_rank":
		info.HasRanks = true
	}
}

// parseSmallInt reads a non-negative JSON integer; anything else is 1.
func parseSmallInt(v []byte) int64 {
	if len(v) == 0 || len(v) > 9 {
		return 1
	}
	var n int64
	for _, c := range v {
		if c < '0' || c > '9' {
			return 1
		}
		n = n*10 + int64(c-'0')
	}
	return n
}

// bstr views bytes as a string without copying; only for comparisons.
func bstr(b []byte) string { return unsafe.String(unsafe.SliceData(b), len(b)) }

type scanner struct {
	b []byte
	i int
}

func (s *scanner) end() error {
	s.skipWS()
	if s.i != len(s.b) {
		return ErrBadJSON
	}
	return nil
}

func (s *scanner) skipWS() {
	for s.i < len(s.b) {
		switch s.b[s.i] {
		case ' ', '\t', '\n', '\r':
			s.i++
		default:
			return
		}
	}
}

// value skips one JSON value starting at s.i.
func (s *scanner) value(depth int) error {
	if depth > maxDepth {
		return ErrTooDeep
	}
	if s.i >= len(s.b) {
		return ErrBadJSON
	}
	switch c := s.b[s.i]; {
	case c == '"':
		return s.str()
	case c == '{':
		return s.object(depth, nil)
	case c == '[':
		return s.array(depth)
	case c == 't':
		return s.lit("true")
	case c == 'f':
		return s.lit("false")
	case c == 'n':
		return s.lit("null")
	case c == '-' || (c >= '0' && c <= '9'):
		return s.number()
	}
	return ErrBadJSON
}

func (s *scanner) lit(l string) error {
	if len(s.b)-s.i < len(l) || string(s.b[s.i:s.i+len(l)]) != l {
		return ErrBadJSON
	}
	s.i += len(l)
	return nil
}

// object skips an object; with info set (the top level only) it records
// the fields routing needs.
func (s *scanner) object(depth int, info *Info) error {
	s.i++ // '{'
	s.skipWS()
	if s.i < len(s.b) && s.b[s.i] == '}' {
		s.i++
		return nil
	}
	for {
		s.skipWS()
		keyStart := s.i
		if s.i >= len(s.b) || s.b[s.i] != '"' {
			return ErrBadJSON
		}
		if err := s.str(); err != nil {
			return err
		}
		keyEnd := s.i - 1
		s.skipWS()
		if s.i >= len(s.b) || s.b[s.i] != ':' {
			return ErrBadJSON
		}
		s.i++
		s.skipWS()
		valStart := s.i
		if err := s.value(depth + 1); err != nil {
			return err
		}
		if info != nil {
			info.record(s.b[keyStart+1:keyEnd], valStart, s.i, s.b)
		}
		if done, err := s.next('}'); done || err != nil {
			return err
		}
	}
}

func (s *scanner) array(depth int) error {
	s.i++ // '['
	s.skipWS()
	if s.i < len(s.b) && s.b[s.i] == ']' {
		s.i++
		return nil
	}
	for {
		s.skipWS()
		if err := s.value(depth + 1); err != nil {
			return err
		}
		if done, err := s.next(']'); done || err != nil {
			return err
		}
	}
}

// next consumes what follows a member or element: a comma (more to come)
// or the closing bracket (done).
func (s *scanner) next(closing byte) (done bool, err error) {
	s.skipWS()
	if s.i >= len(s.b) {
		return false, ErrBadJSON
	}
	switch s.b[s.i] {
	case ',':
		s.i++
		return false, nil
	case closing:
		s.i++
		return true, nil
	}
	return false, ErrBadJSON
}

// str skips a string, validating escapes and rejecting control characters.
// Plain runs are skipped 8 bytes at a time: string content is most of a
// prompt-carrying body.
func (s *scanner) str() error {
	s.i++ // opening quote
	for s.i < len(s.b) {
		for s.i+8 <= len(s.b) {
			m := specialMask(binary.LittleEndian.Uint64(s.b[s.i:]))
			if m != 0 {
				// The lowest flagged byte is exact (borrows only run upwards):
				// jump straight to the first special byte.
				s.i += bits.TrailingZeros64(m) >> 3
				break
			}
			s.i += 8
		}
		if s.i >= len(s.b) {
			break
		}
		c := s.b[s.i]
		switch {
		case c == '"':
			s.i++
			return nil
		case c == '\\':
			if s.i+1 >= len(s.b) {
				return ErrBadJSON
			}
			switch s.b[s.i+1] {
			case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
				s.i += 2
			case 'u':
				if s.i+6 > len(s.b) {
					return ErrBadJSON
				}
				for _, h := range s.b[s.i+2 : s.i+6] {
					if !isHex(h) {
						return ErrBadJSON
					}
				}
				s.i += 6
			default:
				return ErrBadJSON
			}
		case c < 0x20:
			return ErrBadJSON
		default:
			s.i++
		}
	}
	return ErrBadJSON
}

const (
	lsb = 0x0101010101010101
	msb = 0x8080808080808080
)

// specialMask flags (in each byte's top bit) the bytes of x that are '"',
// '\\' or a control character: the classic SWAR zero-byte tests.
func specialMask(x uint64) uint64 {
	q := x ^ (lsb * '"')
	bs := x ^ (lsb * '\\')
	return ((q-lsb)&^q | (bs-lsb)&^bs | (x-lsb*0x20)&^x) & msb
}

func isHex(c byte) bool {
	return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F')
}

func (s *scanner) number() error {
	start := s.i
	if s.b[s.i] == '-' {
		s.i++
	}
	if s.i >= len(s.b) {
		return ErrBadJSON
	}
	if s.b[s.i] == '0' {
		s.i++
	} else if s.b[s.i] >= '1' && s.b[s.i] <= '9' {
		s.digits()
	} else {
		return ErrBadJSON
	}
	if s.i < len(s.b) && s.b[s.i] == '.' {
		s.i++
		if !s.digits() {
			return ErrBadJSON
		}
	}
	if s.i < len(s.b) && (s.b[s.i] == 'e' || s.b[s.i] == 'E') {
		s.i++
		if s.i < len(s.b) && (s.b[s.i] == '+' || s.b[s.i] == '-') {
			s.i++
		}
		if !s.digits() {
			return ErrBadJSON
		}
	}
	if s.i == start {
		return ErrBadJSON
	}
	return nil
}

func (s *scanner) digits() bool {
	start := s.i
	for s.i < len(s.b) && s.b[s.i] >= '0' && s.b[s.i] <= '9' {
		s.i++
	}
	return s.i > start
}

// ArrayLen counts the elements of the JSON array at sp (already validated),
// and whether every element is itself an array.
func ArrayLen(b []byte, sp Span) (n int, allArrays bool) {
	s := scanner{b: b[:sp.End], i: int(sp.Start)}
	if s.i >= len(s.b) || s.b[s.i] != '[' {
		return 0, false
	}
	s.i++
	allArrays = true
	for {
		s.skipWS()
		if s.i >= len(s.b) || s.b[s.i] == ']' {
			return n, allArrays && n > 0
		}
		if s.b[s.i] != '[' {
			allArrays = false
		}
		if s.value(1) != nil {
			return n, false
		}
		n++
		s.skipWS()
		if s.i < len(s.b) && s.b[s.i] == ',' {
			s.i++
		}
	}
}

// FirstString returns the first string at sp: sp itself when it is a string,
// or its first element when it is an array. Escapes are left as they are:
// the text only feeds routing heuristics.
func FirstString(b []byte, sp Span) []byte {
	if !sp.OK() {
		return nil
	}
	v := b[sp.Start:sp.End]
	if v[0] == '[' {
		s := scanner{b: v, i: 1}
		s.skipWS()
		if s.i < len(v) && v[s.i] == '"' {
			start := s.i
			if s.str() == nil {
				return v[start+1 : s.i-1]
			}
		}
		return nil
	}
	if v[0] == '"' {
		return v[1 : len(v)-1]
	}
	return nil
}

// ObjectField finds key's value Span inside the JSON object at [start,end).
func ObjectField(b []byte, start, end int, key string) Span {
	s := scanner{b: b[:end], i: start}
	s.skipWS()
	if s.i >= len(s.b) || s.b[s.i] != '{' {
		return Span{}
	}
	s.i++
	for {
		s.skipWS()
		if s.i >= len(s.b) || s.b[s.i] != '"' {
			return Span{}
		}
		ks := s.i
		if s.str() != nil {
			return Span{}
		}
		k := s.b[ks+1 : s.i-1]
		s.skipWS()
		if s.i >= len(s.b) || s.b[s.i] != ':' {
			return Span{}
		}
		s.i++
		s.skipWS()
		vs := s.i
		if s.value(1) != nil {
			return Span{}
		}
		if bstr(k) == key {
			return Span{int32(vs), int32(s.i)}
		}
		s.skipWS()
		if s.i < len(s.b) && s.b[s.i] == ',' {
			s.i++
			continue
		}
		return Span{}
	}
}

// ChatRoutingText is what text-aware policies see for a chat request: the
// content of the first message when it is a plain string from a user,
// developer or system message (as sglang-router does).
func ChatRoutingText(b []byte, messages Span) []byte {
	if !messages.OK() || b[messages.Start] != '[' {
		return nil
	}
	s := scanner{b: b[:messages.End], i: int(messages.Start) + 1}
	s.skipWS()
	if s.i >= len(s.b) || s.b[s.i] != '{' {
		return nil
	}
	first := s.i
	if s.value(1) != nil {
		return nil
	}
	role := ObjectField(b, first, s.i, "role")
	if !role.OK() {
		return nil
	}
	switch bstr(b[role.Start:role.End]) {
	case `"user"`, `"developer"`, `"system"`:
	default:
		return nil
	}
	content := ObjectField(b, first, s.i, "content")
	if !content.OK() || b[content.Start] != '"' {
		return nil
	}
	return b[content.Start+1 : content.End-1]
}
