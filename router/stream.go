package router

import (
	"bytes"
	"context"
	"errors"
	"io"

	"github.com/valyala/fasthttp"
)

// startStream waits for the first body bytes of l's reply and, in PD
// mode, for prefill's reply head, so that a failure before them can still
// be answered with a proper status (and retried), then makes the rest the
// response body (streamRelay: in PD mode written on the hijacked
// connection, streamconn.go; in regular mode by fasthttp), which now owns
// the leg. a is nil in regular mode.
func (s *Server) startStream(ctx *fasthttp.RequestCtx, r *request, l *leg, a *attempt) (*apiError, bool) {
	l.resp.idleTimeout(s.cfg.StreamIdleTimeout)
	// In a small frame: the stack parked here is the stream's while it
	// waits for its first token (streamconn.go).
	if l.resp.h2 != nil {
		l.resp.packHead()
		l.resp.awaitH2C()
	} else {
		l.resp.awaitBody()
	}
	return s.firstChunk(ctx, r, l, a)
}

// firstChunk is startStream once the first body bytes have arrived.
func (s *Server) firstChunk(ctx *fasthttp.RequestCtx, r *request, l *leg, a *attempt) (*apiError, bool) {
	bufp := chunkPool.Get().(*[]byte)
	n, err := readSome(l.resp, *bufp)
	if err == nil {
		n, err = l.resp.readBuffered(*bufp, n)
	}
	if err == nil && s.cfg.PDDisaggregation {
		n, err = completeErrorEvent(l.resp, *bufp, n, true)
	}
	a.scanDecode((*bufp)[:n])
	if n == 0 && err != nil && err != io.EOF {
		l.bodyFailed()
		if err == errStreamIdle && l.sc.Cause() == nil {
			r.cancel(errStreamIdle) // before the leg closes: cut short, its engine hears the abort
		}
		l.close()
		chunkPool.Put(bufp)
		if f := a.failure(); f != nil {
			return f, false // JSON even for a stream: nothing was sent yet (as OpenAI and SGLang)
		}
		a.abandon()
		if r.clientGone() {
			return nil, false
		}
		if err == errStreamIdle { // not retried: the request ended above, and both engines hear an abort
			return s.streamIdle(l), false
		}
		return &apiError{Status: 502, Code: l.w.Type.String() + "_server_error", Message: "Upstream stream failed: " + err.Error(), sse: true}, false
	}
	// Decode may answer before prefill has (an engine that does not wait
	// for the KV, a mock): the client has had nothing yet, so a prefill
	// failure is still a retryable error, as for a non-stream.
	if f := a.prefillVerdict(); f != nil {
		l.close()
		chunkPool.Put(bufp)
		return f, false
	}
	var merge *logprobMerger
	if prefill, ok := a.logprobs(r); ok {
		merge = newLogprobMerger(prefill)
	}
	ctx.SetStatusCode(l.resp.StatusCode)
	copyHeaders(ctx, l.resp)
	ctx.SetContentType("text/event-stream")
	first := (*bufp)[:n]
	sr := &streamRelay{r: r, leg: l, attempt: a, bufp: bufp, readErr: err, merge: merge}
	sr.see(first)
	first = sr.scrub(first, true)
	if merge != nil {
		first = merge.feed(first)
	}
	sr.pending = first
	if s.cfg.PDDisaggregation {
		r.relay = sr // written on the hijacked connection (streamconn.go)
	} else {
		ctx.Response.SetBodyStream(sr, -1)
	}
	return nil, true
}

// streamIdle is the error of a stream whose worker went silent.
func (s *Server) streamIdle(l *leg) *apiError {
	return &apiError{Status: 504, Code: "stream_idle_timeout", sse: true,
		Message: "no data from the " + l.w.Type.String() + " worker for " + s.cfg.StreamIdleTimeout.String()}
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

// streamRelay is the client's response body: the stream's goroutine (in
// regular mode fasthttp's connection goroutine) pulls the worker's SSE
// chunks through it and writes what each read returns (every chunk the
// worker's connection holds) as one HTTP chunk.
type streamRelay struct {
	r       *request
	leg     *leg     // the worker's reply, whose body is relayed
	attempt *attempt // the PD attempt, for prefill's failure; nil in regular mode
	bufp    *[]byte  // the first chunk's buffer, kept only while a merger needs one
	pending []byte   // next bytes for the client
	readErr error    // how the worker's body ended, once it has
	merge   *logprobMerger
	cw      chunkWriter // PD mode: the client's connection (streamconn.go)
	sent    bool        // the first byte went out
	ended   bool        // the last bytes are pending: nothing more to read
	closed  bool        // CloseWithError ran
	keep    bool        // PD mode: the connection may serve the client's next request
	// resumeFn is resume (streamconn.go), started by the h2c stream's
	// reader for each event of a PD stream.
	resumeFn func()
	first    [1]byte // relay's wait for the next event reads its first byte here

	tail  [16]byte // the last bytes the worker sent (see)
	tailN int
}

// errUnframedEnd ends a stream without HTTP framing that the worker closed
// before [DONE]: its close is then no end but a failure.
var errUnframedEnd = errors.New("the worker closed its stream before [DONE]")

// saw takes the worker's next bytes into the record (the KV transfer time
// they may report) and the stream's tail.
func (sr *streamRelay) saw(b []byte) {
	sr.attempt.scanDecode(b)
	sr.see(b)
}

// see keeps the last bytes of the worker's stream.
func (sr *streamRelay) see(b []byte) {
	if len(b) >= len(sr.tail) {
		sr.tailN = copy(sr.tail[:], b[len(b)-len(sr.tail):])
		return
	}
	keep := min(sr.tailN, len(sr.tail)-len(b))
	copy(sr.tail[:keep], sr.tail[sr.tailN-keep:sr.tailN])
	sr.tailN = keep + copy(sr.tail[keep:], b)
}

// lineStart reports whether the worker's stream so far ends a line.
func (sr *streamRelay) lineStart() bool { return sr.tailN == 0 || sr.tail[sr.tailN-1] == '\n' }

// kvErrors reports whether the stream may carry an engine's error about
// the KV transfer: in PD mode, SGLang's or vLLM's.
func (sr *streamRelay) kvErrors() bool { return sr.r.s.cfg.PDDisaggregation }

// scrub is what the client gets of the worker's bytes b (lineStart: after
// a line's end): in PD mode, its error events about the KV transfer are
// the router's own (sseerror.go).
func (sr *streamRelay) scrub(b []byte, lineStart bool) []byte {
	if !sr.kvErrors() {
		return b
	}
	return scrubKVErrors(b, sr.leg.w.Type.String(), lineStart)
}

// cleanEnd reports whether the worker's body ending is the stream's end: a
// framed body ended as its framing says, an unframed one (ended by the
// connection's close, which a crash does too) after [DONE].
func (sr *streamRelay) cleanEnd() bool {
	if sr.leg.resp.Header.ContentLength() != -2 {
		return true
	}
	return bytes.HasSuffix(bytes.TrimRight(sr.tail[:sr.tailN], " \r\n"), []byte("data: [DONE]"))
}

// relay writes the stream to w, one Write a chunk: each pass waits for the
// worker's next event holding no buffer, reads what has arrived into a
// pooled one, writes it as one HTTP chunk and gives the buffer back, so an
// open stream holds none between events. An h2c stream waits here, in a
// frame shallow enough that the stack of the stream's goroutine shrinks to
// 4 KiB, in regular mode (a PD one waits holding no goroutine: resume,
// streamconn.go); an HTTP/1.1 one waits in its read, which alone knows
// whether its body has more to come.
func (sr *streamRelay) relay(w io.Writer) error {
	for {
		if resp := sr.leg.resp; resp.h2 != nil && sr.waiting() {
			sr.beforeWait()
			resp.awaitH2C()
		}
		if err := sr.pass(w); err != nil || sr.ended {
			return err
		}
	}
}

// beforeWait gives back the first chunk's buffer, written, unless a merger
// reads into it: a stream holds none between events.
func (sr *streamRelay) beforeWait() {
	if sr.merge == nil {
		sr.releaseBuf()
	}
}

// waiting reports whether the relay has nothing to write before the
// worker's next bytes.
func (sr *streamRelay) waiting() bool { return len(sr.pending) == 0 && sr.readErr == nil }

// pass writes the client's next bytes to w: those pending, or what the
// worker's next read brings.
func (sr *streamRelay) pass(w io.Writer) error {
	out, bufp := sr.nextOut()
	var err error
	if len(out) > 0 {
		if !sr.sent {
			sr.r.observeFirstByte()
			sr.sent = true
		}
		_, err = w.Write(out)
	}
	if bufp != nil {
		chunkPool.Put(bufp)
	}
	return err
}

// WriteTo is how fasthttp writes a regular-mode stream
// (fasthttp.BodyWriterTo, instead of Read through a copy buffer it would
// hold for the whole stream).
func (sr *streamRelay) WriteTo(w io.Writer) (int64, error) { return 0, sr.relay(w) }

// SupportsBodyWriteTo tells fasthttp that WriteTo writes what Read returns.
func (sr *streamRelay) SupportsBodyWriteTo() bool { return true }

// Read is the io.Reader fasthttp's SetBodyStream takes; WriteTo is what it
// uses. Once the first chunk is out, chunks are read straight into p.
func (sr *streamRelay) Read(p []byte) (int, error) {
	for len(sr.pending) == 0 {
		if sr.ended {
			return 0, io.EOF
		}
		if sr.merge == nil {
			sr.releaseBuf()
			sr.pending = sr.next(p)
		} else {
			sr.pending = sr.next(*sr.bufp)
		}
	}
	if !sr.sent {
		sr.r.observeFirstByte()
		sr.sent = true
	}
	n := copy(p, sr.pending)
	sr.pending = sr.pending[n:]
	return n, nil
}

// CloseWithError is fasthttp's end of a regular-mode stream, written or
// not.
func (sr *streamRelay) CloseWithError(writeErr error) error {
	if !sr.closed {
		sr.closed = true
		sr.end(writeErr)
	}
	return nil
}

// nextOut returns the client's next bytes and, when they are in a pooled
// buffer of their own, that buffer, to be given back once they are written.
func (sr *streamRelay) nextOut() ([]byte, *[]byte) {
	if len(sr.pending) > 0 { // the first chunk, in sr.bufp
		out := sr.pending
		sr.pending = nil
		return out, nil
	}
	if sr.merge != nil || sr.readErr != nil {
		return sr.next(sr.mergeBuf()), nil
	}
	sr.releaseBuf()
	resp := sr.leg.resp
	n, err := readSome(resp, sr.first[:])
	if n == 0 {
		sr.readErr = err
		return sr.next(nil), nil
	}
	bufp := chunkPool.Get().(*[]byte)
	buf := *bufp
	buf[0] = sr.first[0]
	// The rest of the event is read only if it has arrived: a read of the
	// one byte ends mid-chunk, where a read of what is buffered cannot wait.
	if err == nil && resp.buffered() {
		var m int
		m, err = resp.Read(buf[n:])
		n += m
		if err == nil {
			n, err = resp.readBuffered(buf, n)
		}
	}
	lineStart := sr.lineStart()
	if err == nil && sr.kvErrors() {
		n, err = completeErrorEvent(resp, buf, n, lineStart)
	}
	sr.readErr = err
	sr.saw(buf[:n])
	return sr.scrub(buf[:n], lineStart), bufp
}

// mergeBuf is the buffer next reads into: the merger's own, or none once
// the worker's body has ended (next then only ends the stream).
func (sr *streamRelay) mergeBuf() []byte {
	if sr.bufp == nil {
		return nil
	}
	return *sr.bufp
}

// next reads the worker's next chunk into buf and returns what the client
// gets for it: the chunk (logprobs merged) or, when the worker's stream
// broke, one valid SSE error event (prefill's error if prefill is what
// failed).
func (sr *streamRelay) next(buf []byte) []byte {
	if sr.readErr == nil {
		var n int
		lineStart := sr.lineStart()
		n, sr.readErr = sr.leg.resp.Read(buf)
		if n > 0 && sr.readErr == nil {
			n, sr.readErr = sr.leg.resp.readBuffered(buf, n)
		}
		if n > 0 && sr.readErr == nil && sr.kvErrors() {
			n, sr.readErr = completeErrorEvent(sr.leg.resp, buf, n, lineStart)
		}
		sr.saw(buf[:n])
		if n > 0 {
			out := sr.scrub(buf[:n], lineStart)
			if sr.merge != nil {
				return sr.merge.feed(out)
			}
			return out
		}
		if sr.readErr == nil {
			return nil
		}
	}
	sr.ended = true
	if sr.readErr == io.EOF {
		if sr.cleanEnd() {
			return nil
		}
		sr.readErr = errUnframedEnd
	}
	sr.leg.bodyFailed()
	if sr.readErr == errStreamIdle {
		// The worker is blamed (bodyFailed, above); ending the request
		// now cancels prefill too, and both engines hear an abort.
		sr.r.cancel(errStreamIdle)
		return sr.r.s.streamIdle(sr.leg).sseFrame()
	}
	e := sr.attempt.failure()
	if e == nil {
		sr.attempt.abandon() // a prefill still running has no stream to serve
		if sr.r.clientGone() {
			return nil
		}
		e = &apiError{Status: 502, Code: sr.leg.w.Type.String() + "_stream_error", Message: "Upstream stream ended early: " + sr.readErr.Error()}
		// A cancelled read fails with the connection's deadline error; the
		// request's scope says whether the request timeout was the reason.
		switch cause := sr.r.scope.Cause(); {
		case errors.Is(cause, context.DeadlineExceeded):
			e = &apiError{Status: 504, Code: "request_timeout", Message: "request timed out while streaming"}
		case cause == errShuttingDown:
			e = shuttingDown()
		}
	}
	return e.sseFrame()
}

// end ends the stream, written or not. A stream cut short (the client
// gone, the server shutting down) cancels both legs.
func (sr *streamRelay) end(writeErr error) {
	if writeErr != nil || !sr.ended || len(sr.pending) > 0 {
		sr.r.cancel(errClientGone)
	}
	sr.leg.close()
	sr.attempt.releaseBody() // fasthttp reuses the client's buffer once serve returns
	sr.releaseBuf()
	sr.r.finish()
}

func (sr *streamRelay) releaseBuf() {
	if sr.bufp != nil {
		chunkPool.Put(sr.bufp)
		sr.bufp = nil
	}
}
