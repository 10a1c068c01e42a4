package router

import (
	"bytes"

	"github.com/pdrouter/pdrouter/router/splice"
)

// mergeLogprobs reports whether prefill's input_token_logprobs must be
// prepended to decode's: SGLang /generate with return_logprob (the OpenAI
// routes carry no meta_info, so there is nothing to merge).
func (r *request) mergeLogprobs() bool {
	return r.route == routeGenerate && r.info.ReturnLogprob
}

// logprobMerger prepends prefill's input_token_logprobs to every decode SSE
// event that carries meta_info.input_token_logprobs (what SGLang's mini load
// balancer does and sglang-router never manages). Events are reassembled
// across chunk boundaries.
type logprobMerger struct {
	prefix  []byte // prefill's array elements, without brackets
	pending []byte // an incomplete event carried to the next chunk
	out     []byte
}

func newLogprobMerger(prefillBody []byte) *logprobMerger {
	prefix, ok := prefillLogprobs(prefillBody)
	if !ok {
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

// feed returns the complete events of chunk, merged; a partial event is
// held back until its end arrives.
func (m *logprobMerger) feed(chunk []byte) []byte {
	m.pending = append(m.pending, chunk...)
	m.out = m.out[:0]
	for {
		i := bytes.Index(m.pending, []byte("\n\n"))
		if i < 0 {
			break
		}
		m.out = m.mergeEvent(m.out, m.pending[:i+2])
		m.pending = m.pending[i+2:]
	}
	m.pending = append(m.pending[:0:0], m.pending...)
	return m.out
}

// flush returns whatever incomplete event is left at the end of the stream.
func (m *logprobMerger) flush() []byte {
	b := m.pending
	m.pending = nil
	return b
}

func (m *logprobMerger) mergeEvent(dst, ev []byte) []byte {
	data, ok := bytes.CutPrefix(ev, []byte("data: "))
	if !ok {
		data, ok = bytes.CutPrefix(ev, []byte("data:"))
	}
	data = bytes.TrimSpace(data)
	if !ok || len(data) == 0 || data[0] != '{' {
		return append(dst, ev...)
	}
	merged := spliceLogprobs(m.prefix, data)
	dst = append(dst, "data: "...)
	dst = append(dst, merged...)
	return append(dst, "\n\n"...)
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
