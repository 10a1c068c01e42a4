package router

import (
	"bytes"

	"github.com/pdrouter/pdrouter/router/splice"
)

// logprobMerger prepends prefill's input_token_logprobs to every decode SSE
// event that carries meta_info.input_token_logprobs (what SGLang's mini load
// balancer does and sglang-router never manages). It scans the events as
// they pass, holding nothing back: an event of any size reaches the client
// as its bytes arrive, in one pass over them, and the merger keeps only a
// few flags between chunks (a multi-MB logprobs event once cost quadratic
// CPU while it was reassembled).
type logprobMerger struct {
	prefix []byte // prefill's array elements, without brackets
	out    []byte // the last chunk with the prefix put in
	event  sseEventScan
}

func newLogprobMerger(prefillBody []byte) *logprobMerger {
	prefix, ok := prefillLogprobs(prefillBody)
	if !ok || len(prefix) == 0 {
		return nil
	}
	return &logprobMerger{prefix: prefix}
}

// prefillLogprobs are the elements of prefill's input_token_logprobs,
// without brackets, from a JSON reply or the first event of an SSE one.
func prefillLogprobs(prefillBody []byte) ([]byte, bool) {
	doc := prefillBody
	if ev := firstSSEData(prefillBody); ev != nil {
		doc = ev
	}
	sp := logprobSpan(doc)
	if !sp.OK() {
		return nil, false
	}
	return bytes.TrimSpace(doc[sp.Start+1 : sp.End-1]), true
}

// feed returns chunk with the prefix put into the events it carries: chunk
// itself when no array opens in it, else the merger's buffer, valid until
// the next feed.
func (m *logprobMerger) feed(chunk []byte) []byte {
	m.out = m.out[:0]
	from := 0 // chunk[from:] is not in m.out yet
	for i := 0; i < len(chunk); i++ {
		if stops := m.event.stops(); stops != nil {
			for i < len(chunk) && !stops[chunk[i]] {
				i++
			}
			if i == len(chunk) {
				m.event.nl = false
				break
			}
		}
		switch m.event.next(chunk[i]) {
		case insertPrefix: // after chunk[i], the array's '['
			m.out = append(m.out, chunk[from:i+1]...)
			m.out = append(m.out, m.prefix...)
			from = i + 1
		case insertComma: // before chunk[i], the array's first element
			m.out = append(m.out, chunk[from:i]...)
			m.out = append(m.out, ',')
			from = i
		case skipToEventEnd:
			j := bytes.Index(chunk[i:], []byte("\n\n"))
			if j < 0 {
				m.event.nl = chunk[len(chunk)-1] == '\n'
				i = len(chunk)
				break
			}
			i += j + 1
			m.event.endEvent()
		}
	}
	if len(m.out) == 0 { // nothing put in
		return chunk
	}
	return append(m.out, chunk[from:]...)
}

// sseEventScan follows an SSE stream byte by byte as far as merging needs:
// which event it is in, whether that event's data is a JSON object, and
// where in it meta_info.input_token_logprobs opens (the first such key of
// the first meta_info, as spliceLogprobs finds it).
type sseEventScan struct {
	state     scanState
	prefixLen int  // bytes of "data:" matched at the event's start
	nl        bool // the last byte was '\n': one more ends the event

	depth     int  // JSON nesting
	inString  bool // in a JSON string
	escaped   bool // after a backslash in a string
	wantKey   bool // the next string at depth 1 (or in meta_info) is a key
	keyOn     bool // the string being read is such a key
	key       [len("input_token_logprobs")]byte
	keyLen    int // -1 once the key is longer than any we look for
	lastKey   []byte
	metaSeen  bool // the first meta_info key has been met
	metaNext  bool // its value comes next
	inMeta    bool // depth 2 is meta_info's object
	arrayNext bool // meta_info's first input_token_logprobs value comes next
	commaNext bool // the prefix went in: a comma precedes any first element
}

type scanState uint8

const (
	eventStart scanState = iota // matching "data:"
	afterData                   // spaces before the data
	inJSON
	passing // nothing more to merge in this event
)

type scanAction uint8

const (
	keep scanAction = iota
	insertPrefix
	insertComma
	skipToEventEnd
)

func (s *sseEventScan) endEvent() { *s = sseEventScan{} }

// Where next has nothing to do but wait for a few bytes, stops lists them,
// so that feed can skip the rest in a tight loop: in a string that is no
// key its end (or an escape), deeper than keys matter the brackets and
// strings, and
// everywhere a newline.
var stringStops, deepStops = stopSet(`"\\` + "\n"), stopSet(`"{}[]` + "\n")

func stopSet(bytes string) *[256]bool {
	var set [256]bool
	for _, c := range []byte(bytes) {
		set[c] = true
	}
	return &set
}

func (s *sseEventScan) stops() *[256]bool {
	switch {
	case s.state != inJSON || s.escaped || s.keyOn || s.commaNext:
		return nil
	case s.inString:
		return stringStops
	case s.depth > 2 || (s.depth == 2 && !s.inMeta):
		return deepStops
	}
	return nil
}

func (s *sseEventScan) next(c byte) scanAction {
	if c == '\n' {
		if s.nl {
			s.endEvent()
			return keep
		}
		s.nl = true
	} else {
		s.nl = false
	}
	switch s.state {
	case eventStart:
		if c != "data:"[s.prefixLen] {
			s.state = passing
			return keep
		}
		if s.prefixLen++; s.prefixLen == len("data:") {
			s.state = afterData
		}
		return keep
	case afterData:
		switch c {
		case ' ', '\t':
			return keep
		case '{':
			s.state, s.depth, s.wantKey = inJSON, 1, true
			return keep
		}
		s.state = passing
		return keep
	case inJSON:
		return s.json(c)
	}
	if c == '\n' {
		return keep
	}
	return skipToEventEnd
}

func (s *sseEventScan) json(c byte) scanAction {
	if s.inString {
		switch {
		case s.escaped:
			s.escaped = false
		case c == '\\':
			s.escaped = true
			if s.keyOn {
				s.keyLen = -1 // an escaped key is never one we look for
			}
			return keep
		case c == '"':
			s.inString = false
			if s.keyOn && s.keyLen >= 0 {
				s.lastKey = s.key[:s.keyLen]
			}
			s.keyOn = false
			return keep
		}
		if s.keyOn {
			if s.keyLen < 0 || s.keyLen == len(s.key) {
				s.keyLen = -1
			} else {
				s.key[s.keyLen] = c
				s.keyLen++
			}
		}
		return keep
	}
	switch c {
	case ' ', '\t', '\r', '\n':
		return keep
	}
	if s.commaNext {
		s.commaNext = false
		if c != ']' {
			s.state = passing
			return insertComma
		}
		s.state = passing
		return keep
	}
	keyed := s.depth == 1 || (s.depth == 2 && s.inMeta)
	value := !s.wantKey && c != ',' && c != ':' && c != '}' && c != ']'
	metaValue, arrayValue := value && s.metaNext, value && s.arrayNext
	if value {
		s.metaNext, s.arrayNext = false, false
	}
	switch c {
	case '"':
		s.inString = true
		s.keyOn = keyed && s.wantKey
		s.keyLen, s.lastKey = 0, nil
		s.wantKey = false
	case ':':
		if s.depth == 1 && !s.metaSeen && string(s.lastKey) == "meta_info" {
			s.metaSeen, s.metaNext = true, true
		} else if s.depth == 2 && s.inMeta && string(s.lastKey) == "input_token_logprobs" {
			s.inMeta, s.arrayNext = false, true // only the first such key counts
		}
	case ',':
		s.wantKey = keyed
	case '{', '[':
		s.depth++
		s.wantKey = c == '{'
		if metaValue && c == '{' {
			s.inMeta = true
		}
		if arrayValue && c == '[' {
			s.commaNext = true
			return insertPrefix
		}
	case '}', ']':
		s.depth--
		s.wantKey = false
		if s.depth == 1 && s.metaSeen {
			s.state = passing // meta_info ended without the array
		}
		if s.depth == 0 {
			s.state = passing
		}
	}
	return keep
}

// mergeLogprobsJSON merges a non-streaming reply. A decode body that is not
// an object with the array (a batch, an OpenAI reply) passes unchanged.
func mergeLogprobsJSON(prefillBody, decodeBody []byte) []byte {
	prefix, ok := prefillLogprobs(prefillBody)
	if !ok {
		return decodeBody
	}
	return spliceLogprobs(prefix, decodeBody)
}

// spliceLogprobs returns doc with prefix's elements put at the front of its
// meta_info.input_token_logprobs array; everything else is untouched.
func spliceLogprobs(prefix, doc []byte) []byte {
	sp := logprobSpan(doc)
	if !sp.OK() || len(prefix) == 0 {
		return doc
	}
	inner := bytes.TrimSpace(doc[sp.Start+1 : sp.End-1])
	out := make([]byte, 0, len(doc)+len(prefix)+1)
	out = append(out, doc[:sp.Start+1]...)
	out = append(out, prefix...)
	if len(inner) > 0 {
		out = append(out, ',')
	}
	out = append(out, doc[sp.Start+1:]...)
	return out
}

// logprobSpan finds meta_info.input_token_logprobs when it is an array.
func logprobSpan(doc []byte) splice.Span {
	var info splice.Info
	if splice.Inspect(doc, &info) != nil {
		return splice.Span{}
	}
	meta := splice.ObjectField(doc, 0, len(doc), "meta_info")
	if !meta.OK() {
		return splice.Span{}
	}
	arr := splice.ObjectField(doc, int(meta.Start), int(meta.End), "input_token_logprobs")
	if !arr.OK() || doc[arr.Start] != '[' {
		return splice.Span{}
	}
	return arr
}

// firstSSEData returns the JSON of the first `data:` event of an SSE body.
func firstSSEData(body []byte) []byte {
	rest, ok := bytes.CutPrefix(bytes.TrimLeft(body, " \r\n"), []byte("data:"))
	if !ok {
		return nil
	}
	if i := bytes.Index(rest, []byte("\n")); i >= 0 {
		rest = rest[:i]
	}
	return bytes.TrimSpace(rest)
}
