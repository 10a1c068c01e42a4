package router

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"runtime/debug"
	"sync"
	"time"

	"github.com/valyala/fasthttp"
)

// Request bodies are read into one buffer of their exact size: fasthttp
// rounded a Content-Length body up to a power of two and grew a chunked
// one by copies, quadratic past 100 MB (a 500 MB chunked body peaked at
// 3.2 GB). frameBody tells fasthttp a large or chunked body is empty, and
// the client connection (headConn) keeps it there whole for the router to
// read. Not fasthttp's StreamRequestBody: in PD mode a streamed body pins
// the connection's read buffer (MaxHeaderSize) for the connection's life,
// which a PD stream otherwise does not hold (ReduceMemoryUsage), and in
// regular mode the stream (its set-up, a copy, the discard after the
// handler) cost 8 % of a small request's CPU (bench/RESULTS.md).

// smallBody is the largest body left in fasthttp's pooled buffer (all of it
// arrived with the head, fasthttp's prefetch); a larger one gets a buffer
// of its own, dropped when its response is written.
const smallBody = 8 << 10

// largeBody is the size from which a finished body's memory is handed back
// to the OS at once rather than at the next GC (largeBodies).
const largeBody = 16 << 20

var smallBodies = sync.Pool{New: func() any { b := make([]byte, 0, smallBody); return &b }}

// readBody reads the client's body that frameBody left on the connection
// and sets it as the request's, or answers why not: 413 as soon as it
// crosses --max-payload-size, 400 or 408 for a body that breaks off. Its
// buffer is released when fasthttp resets the request, after the response
// (a stream's included). A small body fasthttp has read already.
func (s *Server) readBody(ctx *fasthttp.RequestCtx) *apiError {
	if n, left := leftBody(&ctx.Request.Header); left {
		return s.readLeftBody(ctx, n)
	}
	return nil
}

// setBody reads a body of n bytes (-1: chunked, stream decodes it) and
// sets it as the request's.
func (s *Server) setBody(ctx *fasthttp.RequestCtx, n int, stream io.Reader) *apiError {
	var body []byte
	var err error
	if n >= 0 {
		body = make([]byte, n)
		_, err = io.ReadFull(stream, body)
	} else {
		body, err = readChunked(stream, s.cfg.MaxPayloadSize)
	}
	if len(body) >= largeBody {
		ctx.SetUserValue(bodyKey{}, &s.large)
	}
	switch {
	case errors.Is(err, fasthttp.ErrBodyTooLarge):
		return s.tooLarge()
	case errors.Is(err, io.ErrUnexpectedEOF):
		return badRequest("request body ended before its length")
	case err != nil:
		return malformed(err)
	}
	ctx.Request.SetBodyRaw(body)
	return nil
}

// readChunked reads a body of unknown length into one buffer of its size:
// a small one through a pooled buffer, a larger one through scratch memory
// that grows without copies (bodyScratch).
func readChunked(stream io.Reader, limit int) ([]byte, error) {
	b := smallBodies.Get().(*[]byte)
	defer smallBodies.Put(b)
	small, err := readAtMost((*b)[:smallBody], stream)
	if err != nil || len(small) < smallBody {
		return bytes.Clone(small), err
	}
	scratch := newBodyScratch(limit + 1)
	defer scratch.free()
	scratch.append(small)
	for scratch.len() <= limit {
		n, err := stream.Read(scratch.tail())
		scratch.grow(n)
		if err == io.EOF {
			return scratch.copy(), nil
		}
		if err != nil {
			return nil, err
		}
	}
	return nil, fasthttp.ErrBodyTooLarge
}

// readAtMost fills buf from r, or returns what came before r's end. A
// short read for any other reason is r's error (io.ReadFull's
// ErrUnexpectedEOF would hide a chunked body cut off).
func readAtMost(buf []byte, r io.Reader) ([]byte, error) {
	n := 0
	for n < len(buf) {
		m, err := r.Read(buf[n:])
		n += m
		if err == io.EOF {
			break
		}
		if err != nil {
			return buf[:n], err
		}
	}
	return buf[:n], nil
}

// bodyKey is the request user value that tells largeBodies a large body is
// done with: fasthttp closes user values when it resets the request, after
// the response.
type bodyKey struct{}

// largeBodies gives the memory of large bodies back to the OS once their
// responses are written: a keep-alive connection otherwise left the
// garbage of ten 48 MiB bodies in the heap until the next GC (+193 MiB).
// Releases within reclaimDelay of each other share one collection.
type largeBodies struct {
	mu      sync.Mutex
	pending *time.Timer
	closed  bool
}

const reclaimDelay = 100 * time.Millisecond

func (l *largeBodies) Close() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.pending == nil && !l.closed {
		l.pending = time.AfterFunc(reclaimDelay, l.reclaim)
	}
	return nil
}

func (l *largeBodies) reclaim() {
	l.mu.Lock()
	l.pending = nil
	l.mu.Unlock()
	debug.FreeOSMemory()
}

// stop cancels a pending reclaim (Shutdown).
func (l *largeBodies) stop() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.closed = true
	if l.pending != nil {
		l.pending.Stop()
		l.pending = nil
	}
}

// tooLarge is the 413 for a body over --max-payload-size.
func (s *Server) tooLarge() *apiError {
	return &apiError{Status: 413, Code: "payload_too_large",
		Message: fmt.Sprintf("request body exceeds the limit of %d bytes", s.cfg.MaxPayloadSize)}
}

// expectContinue refuses a body the Content-Length already puts over the
// limit before the client sends it, instead of a 100 Continue.
func (s *Server) expectContinue(ctx *fasthttp.RequestCtx) int {
	if ctx.Request.Header.ContentLength() <= s.cfg.MaxPayloadSize {
		return fasthttp.StatusContinue
	}
	s.setRequestID(ctx)
	writeError(ctx, s.tooLarge())
	return fasthttp.StatusRequestEntityTooLarge
}
