package router

import (
	"errors"
	"unsafe"
)

// Body inspection: one validating pass over the request JSON that records
// only what routing needs, so the body is never unmarshalled.

var (
	errNotObject = errors.New("request body must be a JSON object")
	errBadJSON   = errors.New("request body is not valid JSON")
	errTooDeep   = errors.New("request body nests too deeply")
)

// maxDepth bounds nesting so a hostile body cannot blow the scanner's stack.
const maxDepth = 512

// span is a half-open byte range [start, end) in the body; end == 0 means absent.
type span struct{ start, end int32 }

func (s span) ok() bool { return s.end > 0 }

// bodyInfo is what routing reads from a request body.
type bodyInfo struct {
	stream        bool
	returnLogprob bool // /generate return_logprob:true
	logprobs      bool // OpenAI logprobs present and not false/null
	n             int64
	text          span // /generate "text" value (string or array)
	prompt        span // /v1/completions "prompt" value
	inputIDs      span // /generate "input_ids" value
	messages      span // /v1/chat/completions "messages" value
	query         span // /v1/rerank "query" value
	model         span // "model" value
	// values of the client's own bootstrap fields, to be overwritten, in
	// bootstrapKeys order
	bootstrap [3]span
}

var bootstrapKeys = [3]string{"bootstrap_host", "bootstrap_port", "bootstrap_room"}

// inspectBody validates that body is exactly one JSON object and fills info.
func inspectBody(body []byte, info *bodyInfo) error {
	*info = bodyInfo{n: 1}
	s := scanner{b: body}
	s.skipWS()
	if s.i >= len(s.b) || s.b[s.i] != '{' {
		if s.i < len(s.b) && s.value(0) == nil {
			return errNotObject
		}
		return errBadJSON
	}
	s.i++
	s.skipWS()
	if s.i < len(s.b) && s.b[s.i] == '}' {
		s.i++
		return s.end()
	}
	for {
		s.skipWS()
		keyStart := s.i
		if s.i >= len(s.b) || s.b[s.i] != '"' {
			return errBadJSON
		}
		if err := s.str(); err != nil {
			return err
		}
		key := s.b[keyStart+1 : s.i-1]
		s.skipWS()
		if s.i >= len(s.b) || s.b[s.i] != ':' {
			return errBadJSON
		}
		s.i++
		s.skipWS()
		valStart := s.i
		if err := s.value(1); err != nil {
			return err
		}
		info.record(key, valStart, s.i, s.b)
		s.skipWS()
		if s.i >= len(s.b) {
			return errBadJSON
		}
		switch s.b[s.i] {
		case ',':
			s.i++
		case '}':
			s.i++
			return s.end()
		default:
			return errBadJSON
		}
	}
}

func (info *bodyInfo) record(key []byte, valStart, valEnd int, b []byte) {
	val := b[valStart:valEnd]
	sp := span{int32(valStart), int32(valEnd)}
	// A key with escapes never matches these plain names, which is what a
	// decoder would do too only for unescaped spellings; escaped field names
	// are vanishingly rare and routing then just ignores them.
	switch bstr(key) {
	case "stream":
		info.stream = bstr(val) == "true"
	case "return_logprob":
		info.returnLogprob = bstr(val) == "true"
	case "logprobs":
		info.logprobs = bstr(val) != "false" && bstr(val) != "null"
	case "n":
		info.n = parseSmallInt(val)
	case "text":
		info.text = sp
	case "prompt":
		info.prompt = sp
	case "input_ids":
		info.inputIDs = sp
	case "messages":
		info.messages = sp
	case "query":
		info.query = sp
	case "model":
		info.model = sp
	case "bootstrap_host", "bootstrap_port", "bootstrap_room":
		for i, k := range bootstrapKeys {
			if bstr(key) == k {
				info.bootstrap[i] = sp
			}
		}
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
		return errBadJSON
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
		return errTooDeep
	}
	if s.i >= len(s.b) {
		return errBadJSON
	}
	switch c := s.b[s.i]; {
	case c == '"':
		return s.str()
	case c == '{':
		return s.object(depth)
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
	return errBadJSON
}

func (s *scanner) lit(l string) error {
	if len(s.b)-s.i < len(l) || string(s.b[s.i:s.i+len(l)]) != l {
		return errBadJSON
	}
	s.i += len(l)
	return nil
}

func (s *scanner) object(depth int) error {
	s.i++ // '{'
	s.skipWS()
	if s.i < len(s.b) && s.b[s.i] == '}' {
		s.i++
		return nil
	}
	for {
		s.skipWS()
		if s.i >= len(s.b) || s.b[s.i] != '"' {
			return errBadJSON
		}
		if err := s.str(); err != nil {
			return err
		}
		s.skipWS()
		if s.i >= len(s.b) || s.b[s.i] != ':' {
			return errBadJSON
		}
		s.i++
		s.skipWS()
		if err := s.value(depth + 1); err != nil {
			return err
		}
		s.skipWS()
		if s.i >= len(s.b) {
			return errBadJSON
		}
		switch s.b[s.i] {
		case ',':
			s.i++
		case '}':
			s.i++
			return nil
		default:
			return errBadJSON
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
		s.skipWS()
		if s.i >= len(s.b) {
			return errBadJSON
		}
		switch s.b[s.i] {
		case ',':
			s.i++
		case ']':
			s.i++
			return nil
		default:
			return errBadJSON
		}
	}
}

// str skips a string, validating escapes and rejecting control characters.
func (s *scanner) str() error {
	s.i++ // opening quote
	for s.i < len(s.b) {
		c := s.b[s.i]
		switch {
		case c == '"':
			s.i++
			return nil
		case c == '\\':
			if s.i+1 >= len(s.b) {
				return errBadJSON
			}
			switch s.b[s.i+1] {
			case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
				s.i += 2
			case 'u':
				if s.i+6 > len(s.b) {
					return errBadJSON
				}
				for _, h := range s.b[s.i+2 : s.i+6] {
					if !isHex(h) {
						return errBadJSON
					}
				}
				s.i += 6
			default:
				return errBadJSON
			}
		case c < 0x20:
			return errBadJSON
		default:
			s.i++
		}
	}
	return errBadJSON
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
		return errBadJSON
	}
	if s.b[s.i] == '0' {
		s.i++
	} else if s.b[s.i] >= '1' && s.b[s.i] <= '9' {
		s.digits()
	} else {
		return errBadJSON
	}
	if s.i < len(s.b) && s.b[s.i] == '.' {
		s.i++
		if !s.digits() {
			return errBadJSON
		}
	}
	if s.i < len(s.b) && (s.b[s.i] == 'e' || s.b[s.i] == 'E') {
		s.i++
		if s.i < len(s.b) && (s.b[s.i] == '+' || s.b[s.i] == '-') {
			s.i++
		}
		if !s.digits() {
			return errBadJSON
		}
	}
	if s.i == start {
		return errBadJSON
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

// arrayLen counts the elements of the JSON array at sp (already validated),
// and whether every element is itself an array.
func arrayLen(b []byte, sp span) (n int, allArrays bool) {
	s := scanner{b: b[:sp.end], i: int(sp.start)}
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

// firstString returns the first string at sp: sp itself when it is a string,
// or its first element when it is an array. Escapes are left as they are:
// the text only feeds routing heuristics.
func firstString(b []byte, sp span) []byte {
	if !sp.ok() {
		return nil
	}
	v := b[sp.start:sp.end]
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

// objectField finds key's value span inside the JSON object at [start,end).
func objectField(b []byte, start, end int, key string) span {
	s := scanner{b: b[:end], i: start}
	s.skipWS()
	if s.i >= len(s.b) || s.b[s.i] != '{' {
		return span{}
	}
	s.i++
	for {
		s.skipWS()
		if s.i >= len(s.b) || s.b[s.i] != '"' {
			return span{}
		}
		ks := s.i
		if s.str() != nil {
			return span{}
		}
		k := s.b[ks+1 : s.i-1]
		s.skipWS()
		if s.i >= len(s.b) || s.b[s.i] != ':' {
			return span{}
		}
		s.i++
		s.skipWS()
		vs := s.i
		if s.value(1) != nil {
			return span{}
		}
		if bstr(k) == key {
			return span{int32(vs), int32(s.i)}
		}
		s.skipWS()
		if s.i < len(s.b) && s.b[s.i] == ',' {
			s.i++
			continue
		}
		return span{}
	}
}

// chatRoutingText is what text-aware policies see for a chat request: the
// content of the first message when it is a plain string from a user,
// developer or system message (as sglang-router does).
func chatRoutingText(b []byte, messages span) []byte {
	if !messages.ok() || b[messages.start] != '[' {
		return nil
	}
	s := scanner{b: b[:messages.end], i: int(messages.start) + 1}
	s.skipWS()
	if s.i >= len(s.b) || s.b[s.i] != '{' {
		return nil
	}
	first := s.i
	if s.value(1) != nil {
		return nil
	}
	role := objectField(b, first, s.i, "role")
	if !role.ok() {
		return nil
	}
	switch bstr(b[role.start:role.end]) {
	case `"user"`, `"developer"`, `"system"`:
	default:
		return nil
	}
	content := objectField(b, first, s.i, "content")
	if !content.ok() || b[content.start] != '"' {
		return nil
	}
	return b[content.start+1 : content.end-1]
}
