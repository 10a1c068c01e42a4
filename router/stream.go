package router

import (
	"bytes"
	"context"
	"errors"
	"io"

	"github.com/valyala/fasthttp"

	"github.com/pdrouter/pdrouter/balancer"
	"github.com/pdrouter/pdrouter/router/splice"
)

// startStream waits for the worker's first body bytes, so that a failure
// before them can still be answered with a proper status (and retried),
// then makes the rest the response body (streamRelay). leg is nil in
// regular mode.
func (s *Server) startStream(ctx *fasthttp.RequestCtx, r *request, resp *upstreamResponse, w *balancer.Worker,
	leg *prefillLeg) (*apiError, bool) {
	bufp := chunkPool.Get().(*[]byte)
	n, err := readSome(resp, *bufp)
	if n == 0 && err != nil && err != io.EOF {
		resp.Close()
		w.DecLoad()
		chunkPool.Put(bufp)
		if leg != nil {
			if f := leg.failure(); f != nil {
				return f.forStream(true), false
			}
		}
		if r.clientGone() {
			return nil, false
		}
		return &apiError{Status: 502, Code: w.Type.String() + "_server_error", Message: "Upstream stream failed: " + err.Error(), sse: true}, false
	}
	var merge *logprobMerger
	if leg != nil && r.mergeLogprobs() && leg.wait() {
		merge = newLogprobMerger(leg.body)
	}
	ctx.SetStatusCode(resp.StatusCode)
	copyHeaders(ctx, resp)
	ctx.SetContentType("text/event-stream")
	first := (*bufp)[:n]
	if merge != nil {
		first = merge.feed(first)
	}
	ctx.Response.SetBodyStream(&streamRelay{r: r, resp: resp, w: w, leg: leg, bufp: bufp,
		pending: first, readErr: err, merge: merge}, -1)
	return nil, true
}

// readSome reads until it gets at least one byte or an error.
func readSome(r io.Reader, buf []byte) (int, error) {
	for {
		n, err := r.Read(buf)
		if n > 0 || err != nil {
			return n, err
		}
	}
}

// streamRelay is the client's response body: fasthttp's connection
// goroutine pulls the worker's SSE chunks through it and writes each as one
// flushed HTTP chunk. (SetBodyStreamWriter would put a goroutine and an
// in-memory pipe between the two for every stream.)
type streamRelay struct {
	r       *request
	resp    *upstreamResponse
	w       *balancer.Worker
	leg     *prefillLeg
	bufp    *[]byte
	pending []byte // next bytes for the client
	readErr error  // how the worker's body ended, once it has
	merge   *logprobMerger
	sent    bool // the first byte went out
	ended   bool // the last bytes are pending: nothing more to read
	closed  bool
}

func (sr *streamRelay) Read(p []byte) (int, error) {
	for len(sr.pending) == 0 {
		if sr.ended {
			return 0, io.EOF
		}
		sr.pending = sr.next()
	}
	if !sr.sent {
		sr.r.observeFirstByte()
		sr.sent = true
	}
	n := copy(p, sr.pending)
	sr.pending = sr.pending[n:]
	return n, nil
}

// next reads the worker's next chunk and returns what the client gets for
// it: the chunk (logprobs merged), and at the end what the merger held back
// or, when the worker's stream broke, one valid SSE error event (prefill's
// error if prefill is what failed).
func (sr *streamRelay) next() []byte {
	if sr.readErr == nil {
		buf := *sr.bufp
		var n int
		n, sr.readErr = sr.resp.Read(buf)
		if n > 0 {
			if sr.merge != nil {
				return sr.merge.feed(buf[:n])
			}
			return buf[:n]
		}
		if sr.readErr == nil {
			return nil
		}
	}
	sr.ended = true
	if sr.readErr == io.EOF {
		if sr.merge != nil {
			return sr.merge.flush()
		}
		return nil
	}
	var e *apiError
	if sr.leg != nil {
		e = sr.leg.failure()
	}
	if e == nil {
		if sr.r.clientGone() {
			return nil
		}
		e = &apiError{Status: 502, Code: sr.w.Type.String() + "_stream_error", Message: "Upstream stream ended early: " + sr.readErr.Error()}
		// A cancelled read fails with the connection's deadline error; the
		// request's scope says whether the request timeout was the reason.
		if errors.Is(sr.r.ctx.Cause(), context.DeadlineExceeded) {
			e = &apiError{Status: 504, Code: "request_timeout", Message: "request timed out while streaming"}
		}
	}
	return e.sseFrame()
}

// CloseWithError is fasthttp's end of the body, written or not. A stream
// cut short (the client gone, the server shutting down) cancels both legs.
func (sr *streamRelay) CloseWithError(writeErr error) error {
	if sr.closed {
		return nil
	}
	sr.closed = true
	if writeErr != nil || !sr.ended || len(sr.pending) > 0 {
		sr.r.cancel(errClientGone)
	}
	sr.resp.Close()
	sr.w.DecLoad()
	chunkPool.Put(sr.bufp)
	sr.r.finish()
	return nil
}

// observeFirstByte records the router-side time to first byte.
func (r *request) observeFirstByte() {
	r.metrics.ttft.Observe(since(r.start))
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
	doc := prefillBody
	if ev := firstSSEData(prefillBody); ev != nil {
		doc = ev
	}
	sp := logprobSpan(doc)
	if !sp.OK() {
		return nil
	}
	return &logprobMerger{prefix: bytes.TrimSpace(doc[sp.Start+1 : sp.End-1])}
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
	doc := prefillBody
	if ev := firstSSEData(prefillBody); ev != nil {
		doc = ev
	}
	sp := logprobSpan(doc)
	if !sp.OK() {
		return decodeBody
	}
	return spliceLogprobs(bytes.TrimSpace(doc[sp.Start+1:sp.End-1]), decodeBody)
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
