package router

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"io"
	"strconv"
	"sync"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/pdrouter/pdrouter/balancer"
	"github.com/pdrouter/pdrouter/router/splice"
)

// vLLM's PD protocol (--vllm-pd-disaggregation), as vllm-router, vLLM's
// NIXL proxy (tests/v1/kv_connector/nixl_integration/toy_proxy_server.py)
// and smg (routers/common/kv_transfer.rs) speak it. Unlike SGLang's, the
// legs run one after the other (vllmAttempt):
//
//  1. pick a prefill and a decode worker with each side's policy, both up
//     front: the request id names both (appendVLLMRequestID);
//  2. send prefill the client's body with max_tokens 1 (and
//     max_completion_tokens if sent), min_tokens and min_completion_tokens
//     0, stream false, stream_options null, and kv_transfer_params asking
//     it to keep the KV for a remote decode (vllmPrefillParams); read its
//     whole JSON reply;
//  3. send decode the client's body as sent, with the kv_transfer_params
//     of prefill's reply (remote_engine_id, remote_block_ids, remote_host,
//     remote_port, tp_size, ...: whatever the connector wrote, untouched),
//     and make decode's reply the client's, streamed or not.
//
// Both legs carry the same X-Request-Id, which vLLM takes as the request's
// id and its P2P connector parses for the peer addresses. vLLM has no abort
// endpoint: it aborts a request whose connection closes, which is what
// ending a leg does (upstream.go), so no leg carries an rid.

// vllmFields are the top-level body members the legs rewrite.
var vllmFields = [...]string{"stream", "stream_options", "max_tokens", "max_completion_tokens",
	"min_tokens", "min_completion_tokens", "kv_transfer_params"}

const (
	vfStream = iota
	vfStreamOptions
	vfMaxTokens
	vfMaxCompletionTokens
	vfMinTokens
	vfMinCompletionTokens
	vfKVParams
)

type vllmSpans [len(vllmFields)]splice.Span

// vllmPrefillParams asks a prefill to keep the request's KV for a remote
// decode, in the full form vllm-router and vLLM's proxy send (NIXL reads
// only the two flags; other connectors the nulls too).
var vllmPrefillParams = []byte(`{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,` +
	`"remote_block_ids":null,"remote_host":null,"remote_port":null}`)

// maxPrefillReply bounds a prefill's reply (one token, prompt logprobs at
// most), which is read whole.
const maxPrefillReply = 64 << 20

// vllmAttempt runs one try on a fresh pair: prefill, then decode. Every
// retry starts over with both legs, new workers (preferring those not yet
// failed) and a new request id (README: vLLM PD mode, retries).
func (s *Server) vllmAttempt(ctx *fasthttp.RequestCtx, r *request) (*apiError, bool) {
	if r.route != routeChat && r.route != routeCompletions {
		return &apiError{Status: 400, Code: "pd_unsupported_" + r.route.String(),
			Message: "/" + r.route.String() + " is not supported in vLLM PD disaggregation mode"}, false
	}
	pw, dw, fail := s.pickPair(ctx, r)
	if fail != nil {
		return fail, false
	}
	r.rec.startPD()
	var at vllmSpans
	_ = splice.FindFields(r.body, vllmFields[:], at[:]) // Inspect has passed it
	hp := vllmHeaders.Get().(*[]byte)
	header := appendVLLMHeader((*hp)[:0], r.header, s.hostOf(pw), s.hostOf(dw))
	if cap(header) <= maxPooledHeader {
		*hp = header[:0]
		defer vllmHeaders.Put(hp) // both legs' writes are over when the attempt returns
	}
	// One pooled body for both legs, given back when the attempt returns:
	// by then both are written (HTTP/1.1 writes a body before its reply
	// arrives; h2c sends a copy).
	body := vllmBodies.Get().(*splice.Body)
	defer func() {
		body.Reuse(nil) // holds no client's buffer while pooled
		vllmBodies.Put(body)
	}()
	var pl leg
	defer pl.close() // on the ways out before the close below
	if fail, ok := s.vllmPrefill(r, pw, &pl, &at, header, body); !ok {
		return fail, false
	}
	if pl.trace != nil { // its span ends before decode's starts
		pl.close()
	}
	l := &r.leg
	l.open(r, dw, engineRID{}) // no rid: vLLM's engines are not sent SGLang's aborts
	var err error
	if !l.w.HTTP2 { // decode's request goes out first: closing prefill's leg waits for nothing
		err = l.write(&r.scope, r.path, body, header)
	}
	// Prefill's leg closes (its connection pooled, the breaker and the
	// load told, about 10 µs) while decode works on its first token.
	pl.close()
	if err == nil {
		err = l.send(&r.scope, r.path, body, header) // HTTP/1.1: waits for the head of what write sent
	}
	if err != nil {
		l.close()
		if r.scope.Err() != nil {
			return nil, false // the client left or the request timed out: serve says which
		}
		return &apiError{Status: 502, Code: "decode_server_error", Message: "Decode server error: " + err.Error()}, false
	}
	if status := l.resp.StatusCode; status/100 != 2 {
		e := upstreamError("decode", status, readError(l.resp))
		l.close()
		if r.info.Stream {
			e.Status, e.sse = status, true
		}
		return e, false
	}
	return s.reply(ctx, r, l, nil)
}

// vllmPrefill runs the prefill leg l on pw with body as its body, then
// makes body the decode's: the client's with the kv_transfer_params of
// prefill's reply (JSON null when it has none: decode then computes the
// prompt itself, as with vllm-router and vLLM's proxy). ok is false when
// the attempt is over: fail says why, nil when the request's scope ended.
// The caller closes l.
func (s *Server) vllmPrefill(r *request, pw *balancer.Worker, l *leg, at *vllmSpans, header []byte, body *splice.Body) (fail *apiError, ok bool) {
	vllmPrefillBody(body, r.body, at)
	l.open(r, pw, engineRID{})
	if err := l.send(&r.scope, r.path, body, header); err != nil {
		if r.scope.Err() != nil {
			return nil, false
		}
		return &apiError{Status: 502, Code: "prefill_server_error", Message: "Prefill server error: " + err.Error()}, false
	}
	if status := l.resp.StatusCode; status/100 != 2 {
		return upstreamError("prefill", status, readError(l.resp)), false
	}
	bufp := chunkPool.Get().(*[]byte)
	defer chunkPool.Put(bufp)
	reply, err := readUpTo((*bufp)[:0], l.resp, maxPrefillReply)
	var found [1]splice.Span
	if err == nil { // one pass: the reply is valid JSON, and where its params are
		err = splice.FindFields(reply, kvParamsKey[:], found[:])
	}
	if err != nil {
		if r.scope.Err() != nil {
			return nil, false
		}
		l.bodyFailed()
		return &apiError{Status: 502, Code: "prefill_server_error", Message: "Prefill server error: reading its reply: " + err.Error()}, false
	}
	r.rec.prefilled(time.Since(r.rec.pdStart))
	params := jsonNull
	if found[0].OK() {
		params = reply[found[0].Start:found[0].End]
	}
	body.Reuse(r.body)                                     // prefill's body is written: the decode's takes its place
	body.Set("kv_transfer_params", at[vfKVParams], params) // a copy: the reply's buffer goes back to its pool
	return nil, true
}

// readUpTo reads rd to its end into b, growing b only for a reply longer
// than its capacity, and fails past limit bytes.
func readUpTo(b []byte, rd io.Reader, limit int) ([]byte, error) {
	for {
		if len(b) == cap(b) {
			b = append(b, 0)[:len(b)]
		}
		n, err := rd.Read(b[len(b):cap(b)])
		b = b[:len(b)+n]
		switch {
		case len(b) > limit:
			return b, errPrefillReplyTooLarge
		case err == io.EOF:
			return b, nil
		case err != nil:
			return b, err
		}
	}
}

var (
	kvParamsKey = [...]string{"kv_transfer_params"}

	jsonNull  = []byte("null")
	jsonOne   = []byte("1")
	jsonZero  = []byte("0")
	jsonFalse = []byte("false")

	errPrefillReplyTooLarge = errors.New("longer than " + strconv.Itoa(maxPrefillReply>>20) + " MiB")
)

// vllmPrefillBody makes b the client's body src as a prefill runs it: one
// token, no minimum (vLLM refuses min_tokens above max_tokens), not
// streamed (its kv_transfer_params come in the JSON reply), and asking for
// the KV to be kept. A client's own kv_transfer_params are replaced.
func vllmPrefillBody(b *splice.Body, src []byte, at *vllmSpans) {
	b.Reuse(src)
	b.Set("max_tokens", at[vfMaxTokens], jsonOne)
	if at[vfMaxCompletionTokens].OK() {
		b.Set("max_completion_tokens", at[vfMaxCompletionTokens], jsonOne)
	}
	for _, f := range []int{vfMinTokens, vfMinCompletionTokens} {
		if at[f].OK() {
			b.Set(vllmFields[f], at[f], jsonZero)
		}
	}
	b.Set("stream", at[vfStream], jsonFalse)
	if at[vfStreamOptions].OK() { // vLLM refuses stream_options without stream
		b.Set("stream_options", at[vfStreamOptions], jsonNull)
	}
	b.Set("kv_transfer_params", at[vfKVParams], vllmPrefillParams)
}

// appendVLLMRequestID appends vllm-router's request id for a pair:
// ___prefill_addr_HOST:PORT___decode_addr_HOST:PORT_UUID, fresh per
// attempt. vLLM's P2P NCCL connector reads the peer's address from it;
// the others only need both legs to carry the same id.
func appendVLLMRequestID(b []byte, prefill, decode string) []byte {
	b = append(append(b, "___prefill_addr_"...), prefill...)
	b = append(append(b, "___decode_addr_"...), decode...)
	b = append(b, '_')
	// The random bytes go past the hex's end in b itself: an array of
	// their own escapes to the heap through rand.Read.
	n := len(b)
	b = append(b, make([]byte, 2*uuidLen+uuidLen)...)
	_, _ = rand.Read(b[n+2*uuidLen:])
	hex.Encode(b[n:n+2*uuidLen], b[n+2*uuidLen:])
	return b[:n+2*uuidLen]
}

const uuidLen = 16

// hostOf is w's HOST:PORT as its URL writes it (vllm-router's spelling),
// from the upstream's table of registered workers.
func (s *Server) hostOf(w *balancer.Worker) string {
	if _, host, _, err := s.upstream.endpoint(w.BaseURL); err == nil {
		return host
	}
	return w.BaseURL
}

// vllmHeaders and vllmBodies keep an attempt's header lines and legs'
// body from costing an allocation each per request.
var (
	vllmHeaders = sync.Pool{New: func() any { b := make([]byte, 0, 1024); return &b }}
	vllmBodies  = sync.Pool{New: func() any { return new(splice.Body) }}
)

// maxPooledHeader bounds the header buffers kept: a client's huge headers
// are not worth keeping memory for.
const maxPooledHeader = 16 << 10

// appendVLLMHeader appends to out the request's forwarded header lines
// with the pair's request id as X-Request-Id in place of the client's
// (forwardHeaders writes it last).
func appendVLLMHeader(out, header []byte, prefill, decode string) []byte {
	body := bytes.TrimSuffix(header, []byte("\r\n"))
	last := bytes.LastIndex(body, []byte("\r\n")) + 2
	if last == 1 {
		last = 0
	}
	if bytes.HasPrefix(body[last:], []byte("X-Request-Id: ")) {
		header = header[:last]
	}
	out = append(append(out, header...), "X-Request-Id: "...)
	return append(appendVLLMRequestID(out, prefill, decode), "\r\n"...)
}
