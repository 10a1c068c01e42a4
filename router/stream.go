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
// response body (streamRelay), which now owns the leg. a is nil in regular
// mode.
func (s *Server) startStream(ctx *fasthttp.RequestCtx, r *request, l *leg, a *attempt) (*apiError, bool) {
	awaitBody(l.resp)
	bufp := chunkPool.Get().(*[]byte)
	n, err := readSome(l.resp, *bufp)
	if err == nil {
		n, err = readBuffered(l.resp, *bufp, n)
	}
	a.scanDecode((*bufp)[:n])
	if n == 0 && err != nil && err != io.EOF {
		l.bodyFailed()
		l.close()
		chunkPool.Put(bufp)
		if f := a.failure(); f != nil {
			return f, false // JSON even for a stream: nothing was sent yet (as OpenAI and SGLang)
		}
		a.abandon()
		if r.clientGone() {
			return nil, false
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
	if merge != nil {
		first = merge.feed(first)
	}
	l.resp.idleTimeout(s.cfg.StreamIdleTimeout)
	ctx.Response.SetBodyStream(&streamRelay{r: r, leg: l, attempt: a, bufp: bufp,
		pending: first, readErr: err, merge: merge}, -1)
	return nil, true
}

// awaitBody waits until resp's connection has received some of its body,
// in the connection's own reader: a stream waiting long for its first event
// (decode's comes after prefill and the KV transfer) holds no relay buffer
// meanwhile. A body of known length 0 has nothing to wait for, and an error
// is left to the read that follows, which meets it again.
func awaitBody(resp *upstreamResponse) {
	if resp.h2 != nil {
		resp.h2.peek()
		return
	}
	if cl := resp.Header.ContentLength(); resp.conn != nil && (cl == -1 || cl > 0) {
		_, _ = resp.conn.br.Peek(1)
	}
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

// readBuffered adds to buf[:n], which the last read of resp filled short of
// its end, the chunks that resp's connection has already received, as long
// as reading them cannot wait for the network: the events that arrived
// together reach the client in one write (and wake it once) instead of one
// flushed HTTP chunk each. It returns the new length and the error of the
// read that ended the body, if one did.
func readBuffered(resp *upstreamResponse, buf []byte, n int) (int, error) {
	// fasthttp reads a chunked body through the connection's reader, and a
	// read that ends short of its buffer with bytes still buffered has
	// ended at a chunk's end (it would otherwise have taken them): what is
	// buffered starts with the next chunk's size line.
	if resp.Header.ContentLength() != -1 || resp.conn == nil {
		return n, nil
	}
	br := resp.conn.br
	for n < len(buf) {
		next, _ := br.Peek(br.Buffered())
		if !wholeChunk(next) {
			return n, nil
		}
		m, err := resp.Read(buf[n:])
		n += m
		if err != nil || m == 0 {
			return n, err
		}
	}
	return n, nil
}

// wholeChunk reports whether b starts with a whole HTTP chunk with data: its
// size line, its bytes and the CRLF after them, so that reading it takes
// nothing from the network. The last chunk (size 0) is left to the next
// read, since its trailer section can be of any length; a malformed size
// line is too, and fails there.
func wholeChunk(b []byte) bool {
	size, i := 0, 0
	for ; i < len(b) && unhex(b[i]) >= 0; i++ {
		size = size<<4 | unhex(b[i])
	}
	if size == 0 || i > 8 { // a chunk under 4 GiB
		return false
	}
	end := bytes.IndexByte(b[i:], '\n')
	if end < 1 || b[i+end-1] != '\r' {
		return false
	}
	return len(b)-(i+end+1) >= size+2
}

func unhex(c byte) int {
	switch {
	case '0' <= c && c <= '9':
		return int(c - '0')
	case 'a' <= c && c <= 'f':
		return int(c - 'a' + 10)
	case 'A' <= c && c <= 'F':
		return int(c - 'A' + 10)
	}
	return -1
}

// streamRelay is the client's response body: fasthttp's connection
// goroutine pulls the worker's SSE chunks through it and writes what each
// read returns (every chunk the worker's connection holds) as one flushed
// HTTP chunk. (SetBodyStreamWriter would put a goroutine and an
// in-memory pipe between the two for every stream.)
type streamRelay struct {
	r       *request
	leg     *leg     // the worker's reply, whose body is relayed
	attempt *attempt // the PD attempt, for prefill's failure; nil in regular mode
	bufp    *[]byte  // the first chunk's buffer, kept only while a merger needs one
	pending []byte   // next bytes for the client
	readErr error    // how the worker's body ended, once it has
	merge   *logprobMerger
	sent    bool // the first byte went out
	ended   bool // the last bytes are pending: nothing more to read
	closed  bool
	first   [1]byte // WriteTo's wait for the next event reads its first byte here
}

// WriteTo is how fasthttp writes the stream (fasthttp.BodyWriterTo, instead
// of Read through a copy buffer it would hold for the whole stream): each
// pass waits for the worker's next event holding no buffer, reads what has
// arrived into a pooled one, writes it as one flushed HTTP chunk and gives
// the buffer back, so an open stream holds none between events.
func (sr *streamRelay) WriteTo(w io.Writer) (int64, error) {
	var written int64
	for {
		out, bufp := sr.nextOut()
		var err error
		if len(out) > 0 {
			if !sr.sent {
				sr.r.observeFirstByte()
				sr.sent = true
			}
			var n int
			n, err = w.Write(out)
			written += int64(n)
		}
		if bufp != nil {
			chunkPool.Put(bufp)
		}
		if err != nil || sr.ended {
			return written, err
		}
	}
}

// SupportsBodyWriteTo tells fasthttp that WriteTo writes what Read returns.
func (sr *streamRelay) SupportsBodyWriteTo() bool { return true }

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
	if err == nil && resp.buffered() > 0 {
		var m int
		m, err = resp.Read(buf[n:])
		n += m
		if err == nil {
			n, err = readBuffered(resp, buf, n)
		}
	}
	sr.readErr = err
	sr.attempt.scanDecode(buf[:n])
	return buf[:n], bufp
}

// mergeBuf is the buffer next reads into: the merger's own, or none once
// the worker's body has ended (next then only ends the stream).
func (sr *streamRelay) mergeBuf() []byte {
	if sr.bufp == nil {
		return nil
	}
	return *sr.bufp
}

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

// next reads the worker's next chunk into buf and returns what the client
// gets for it: the chunk (logprobs merged) or, when the worker's stream
// broke, one valid SSE error event (prefill's error if prefill is what
// failed).
func (sr *streamRelay) next(buf []byte) []byte {
	if sr.readErr == nil {
		var n int
		n, sr.readErr = sr.leg.resp.Read(buf)
		if n > 0 && sr.readErr == nil {
			n, sr.readErr = readBuffered(sr.leg.resp, buf, n)
		}
		sr.attempt.scanDecode(buf[:n])
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
		return nil
	}
	sr.leg.bodyFailed()
	if sr.readErr == errStreamIdle {
		// The worker is blamed (bodyFailed, above); ending the request
		// now cancels prefill too, and both engines hear an abort.
		sr.r.cancel(errStreamIdle)
		return (&apiError{Status: 504, Code: "stream_idle_timeout", Message: "no data from the " + sr.leg.w.Type.String() +
			" worker for " + sr.r.s.cfg.StreamIdleTimeout.String()}).sseFrame()
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
		if errors.Is(sr.r.scope.Cause(), context.DeadlineExceeded) {
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
	sr.leg.close()
	sr.attempt.releaseBody() // fasthttp reuses the client's buffer next
	sr.releaseBuf()
	sr.r.finish()
	return nil
}

func (sr *streamRelay) releaseBuf() {
	if sr.bufp != nil {
		chunkPool.Put(sr.bufp)
		sr.bufp = nil
	}
}
