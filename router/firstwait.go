package router

import (
	"bytes"
	"encoding/binary"
	"sync"

	"github.com/valyala/fasthttp"
)

// A PD stream whose decode leg is h2c waits for its first token holding
// no goroutine and no RequestCtx. At 10,000 streams that wait was 10,000
// hijack handlers parked in awaitH2C (a 2-4 KiB stack each, and as much
// again of heap headroom: the collector counts stacks in its goal) and
// 10,000 RequestCtxs (~1.8 KiB each with their buffers).
//
// Before its attempts, a PD stream that may reach an h2c worker copies
// what the rest of it reads of ctx into a pooled buffer of its own
// (ownCopy): the client's body, which its legs then send from the copy,
// the headers policies read, its id, the response's header fields so far,
// the request's HTTP version and Connection: close. Copied then, and not
// at the park, because prefill may be writing the body when decode
// answers: the park would have to wait for it.
//
// Once both legs are sent and decode's head is in but none of its body,
// the request parks firstToken on the h2c stream (parkH2C) and unwinds:
// the hijack handler returns, and fasthttp takes its ctx back. Decode's
// first bytes, its end or its failure (prefill failing resets it, and so
// do the client leaving, the stream idle timeout and shutdown, through
// the request's scope) start firstToken on a goroutine of its own: it
// runs the rest of the attempt (firstChunk, prefillVerdict) and of
// serve's retry loop, whose state lives in the request, answering on a
// response of its own (answerCtx) written straight to the client's
// connection, as endStream writes every PD stream's. A decode whose head
// is late still waits for it on the hijack handler (postH2C).

// firstWait is what a parked stream keeps of its RequestCtx.
type firstWait struct {
	own    *[]byte    // from ownBuffers: the body, header and fields below live in it
	header ownHeaders // the client's header lines, for a retry's policies
	fields []byte     // the response's header fields set so far, packed as packHead's
	a      *attempt   // the attempt whose decode leg is awaited
	resume func()     // firstToken, made once
	r      *request
	http10 bool // the request was HTTP/1.0
	close  bool // it asked for Connection: close
}

// ownBuffers hold parked streams' copies, by size: 512 bytes to 16 KiB,
// doubling (a stream holds its copy through its wait, so a buffer fits
// it within twice). A larger copy is allocated and left to the collector.
var ownBuffers [6]sync.Pool

const ownBufferMin = 512

// ownBuffer returns a buffer of at least n bytes' capacity.
func ownBuffer(n int) *[]byte {
	for i, size := 0, ownBufferMin; i < len(ownBuffers); i, size = i+1, size*2 {
		if n <= size {
			if b, ok := ownBuffers[i].Get().(*[]byte); ok {
				return b
			}
			b := make([]byte, 0, size)
			return &b
		}
	}
	b := make([]byte, 0, n)
	return &b
}

// putOwnBuffer gives back a buffer ownBuffer made.
func putOwnBuffer(b *[]byte) {
	for i, size := 0, ownBufferMin; i < len(ownBuffers); i, size = i+1, size*2 {
		if cap(*b) == size {
			*b = (*b)[:0]
			ownBuffers[i].Put(b)
			return
		}
	}
}

// parkFirstToken parks r, whose decode reply (a's) has its head and no
// body yet, until decode's first bytes (or its end, or its failure)
// arrive: true when firstToken now owns r. False, with nothing done, for
// a request without its own copy, an HTTP/1.1 reply, or one whose first
// bytes are in already.
func (s *Server) parkFirstToken(r *request, a *attempt) bool {
	resp := r.leg.resp
	if r.park == nil || resp.h2 == nil || !resp.waitsH2C() {
		return false
	}
	r.park.a = a
	if rt := r.trace; rt != nil {
		rt.rctx = nil // the continuation's response is the one the client gets
	}
	// As startStream: the idle timeout covers the wait, and the reply's
	// head goes back to its pool.
	resp.idleTimeout(s.cfg.StreamIdleTimeout)
	resp.packHead()
	if !resp.parkH2C(r.park.resume) {
		r.park.resume() // the first bytes came meanwhile
	}
	return true
}

// ownCopy copies into r's own buffer what it reads of ctx once ctx has
// gone back to fasthttp, for a park to come.
func (r *request) ownCopy(ctx *fasthttp.RequestCtx) {
	p := &firstWait{r: r, http10: !ctx.Request.Header.IsHTTP11(), close: ctx.Request.Header.ConnectionClose()}
	p.resume = p.firstToken
	need := len(r.body) + len(r.requestID)
	for k, v := range ctx.Request.Header.All() {
		need += len(k) + len(v) + 4
	}
	for k, v := range ctx.Response.Header.All() {
		need += len(k) + len(v) + 2*binary.MaxVarintLen32
	}
	p.own = ownBuffer(need)
	b := append((*p.own)[:0], r.body...)
	bodyEnd := len(b)
	for k, v := range ctx.Request.Header.All() {
		b = append(append(append(append(b, k...), ": "...), v...), "\r\n"...)
	}
	headerEnd := len(b)
	for k, v := range ctx.Response.Header.All() {
		b = binary.AppendUvarint(b, uint64(len(k)))
		b = append(b, k...)
		b = binary.AppendUvarint(b, uint64(len(v)))
		b = append(b, v...)
	}
	fieldsEnd := len(b)
	b = append(b, r.requestID...)
	*p.own = b
	r.body = b[:bodyEnd:bodyEnd]
	p.header = b[bodyEnd:headerEnd:headerEnd]
	p.fields = b[headerEnd:fieldsEnd:fieldsEnd]
	r.requestID = b[fieldsEnd:len(b):len(b)]
	r.park = p
}

// over drops the copy once the stream's first event is out; its buffer
// goes back to the pool when no leg reads it (idle: the attempt's body
// released), else to the collector.
func (p *firstWait) over(idle bool) {
	if idle {
		putOwnBuffer(p.own)
	}
	p.own = nil
}

// firstToken is a parked stream's continuation: decode's first bytes, its
// end or its failure are in. It ends the attempt as pdAttempt would have,
// goes on with serve's retries where it failed, and answers.
func (p *firstWait) firstToken() {
	r := p.r
	s := r.s
	ctx := p.answerCtx()
	a := p.a
	p.a = nil
	fail, streaming := s.firstChunk(ctx, r, &r.leg, a)
	fail, end := r.attemptOver(a, fail, streaming)
	parked := false
	if end == attemptEnded {
		if s.retryable(r, fail) {
			parked = s.attempts(ctx, r, r.attempt+1, fail)
		} else {
			s.answerFailure(ctx, r, fail)
		}
	}
	if !parked {
		s.endStream(ctx, r)
	}
	releaseAnswerCtx(ctx)
}

// answerCtxs hold the responses continuations answer on: a RequestCtx of
// our own (not fasthttp's, which went back to it at the park), so that the
// answer is written by the code every stream's is; its request carries
// only what endStream reads of the client's.
var answerCtxs = sync.Pool{New: func() any { return new(fasthttp.RequestCtx) }}

// answerCtx is a response with the header fields the client's had at the
// park.
func (p *firstWait) answerCtx() *fasthttp.RequestCtx {
	ctx := answerCtxs.Get().(*fasthttp.RequestCtx)
	if p.http10 {
		ctx.Request.Header.SetProtocol("HTTP/1.0")
	}
	if p.close {
		ctx.Request.Header.SetConnectionClose()
	}
	h := &ctx.Response.Header
	for b := p.fields; len(b) > 0; {
		var k, v []byte
		k, b = packedField(b)
		v, b = packedField(b)
		switch string(k) {
		case fasthttp.HeaderContentType:
			h.SetContentTypeBytes(v)
		case fasthttp.HeaderContentLength, fasthttp.HeaderConnection:
		case fasthttp.HeaderServer:
			h.SetServerBytes(v)
		default:
			h.AddBytesKV(k, v)
		}
	}
	if rt := p.r.trace; rt != nil {
		rt.rctx = ctx // for the status, if the answer ends the request
	}
	return ctx
}

func releaseAnswerCtx(ctx *fasthttp.RequestCtx) {
	ctx.Request.Reset()
	ctx.Response.Reset()
	answerCtxs.Put(ctx)
}

// ownHeaders are the client's header lines, "Name: value\r\n" each, as
// policies see them (balancer.Headers).
type ownHeaders []byte

func (h *ownHeaders) Get(name string) string {
	for b := []byte(*h); len(b) > 0; {
		var line []byte
		line, b, _ = bytes.Cut(b, []byte("\r\n"))
		if k, v, ok := bytes.Cut(line, []byte(": ")); ok && bytes.EqualFold(k, []byte(name)) {
			return string(v)
		}
	}
	return ""
}
