package router

import (
	"context"
	"net"
	"strconv"
	"sync"
	"time"

	"github.com/valyala/fasthttp"
)

// A stream's client connection is hijacked once the handler returns:
// fasthttp's connection goroutine (whose stack, deep in serveConn and the
// response writer, held about 8 KiB for the whole stream) and its 4 KiB
// connection writer go back to their pools, and a goroutine of the
// stream's own, parked in a shallow frame (a few hundred bytes, so the
// collector keeps its stack at the minimum), relays the worker's chunks
// and writes each straight to the socket. The connection closes when the
// stream ends (the head says so): a stream is long beside a new
// connection's cost.

// hijack makes the client connection sr's once the handler returns.
// fasthttp calls serve unless the connection is already closed (its
// SetDeadline failed): no peer is then left to stream to, and the request
// is ended by its scope (the disconnect watch, the request timeout).
func (sr *streamRelay) hijack(ctx *fasthttp.RequestCtx) {
	sr.ctx = ctx
	ctx.HijackSetNoResponse(true)
	ctx.Hijack(sr.serve)
}

// serve writes the head and the stream to c, then ends the stream. ctx
// stays valid until it returns (fasthttp releases it after).
func (sr *streamRelay) serve(c net.Conn) {
	s := sr.r.s
	s.metrics.httpConnections.Inc() // fasthttp counted it out at the hijack
	defer s.metrics.httpConnections.Dec()
	// A client that stops reading frees its stream, as fasthttp's
	// WriteTimeout did for the response it wrote.
	if t := s.srv.WriteTimeout; t > 0 {
		_ = c.SetWriteDeadline(time.Now().Add(t))
	}
	h := &sr.ctx.Response.Header
	h.SetConnectionClose()
	cw := chunkWriter{c: c, chunked: sr.ctx.Request.Header.IsHTTP11()}
	if cw.chunked {
		h.SetContentLength(-1)
	} else { // HTTP/1.0: the body ends with the connection
		h.SetContentLength(-2)
		h.Del(fasthttp.HeaderTransferEncoding)
	}
	cw.head = h.Header()
	_, err := sr.WriteTo(&cw)
	if err == nil {
		err = cw.end()
	}
	sr.end(err)
}

// chunkWriter writes each Write as one HTTP chunk in one write to the
// socket (the head before the first), from a pooled buffer.
type chunkWriter struct {
	c       net.Conn
	head    []byte // not written yet
	chunked bool
}

// framePool holds the buffers chunks are framed in, only while written.
var framePool = sync.Pool{New: func() any { b := make([]byte, 0, 4<<10); return &b }}

func (cw *chunkWriter) Write(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	if _, err := cw.write(p, false); err != nil {
		return 0, err
	}
	return len(p), nil
}

// end writes the last chunk (and the head, for an empty stream).
func (cw *chunkWriter) end() error {
	_, err := cw.write(nil, true)
	return err
}

func (cw *chunkWriter) write(p []byte, last bool) (int, error) {
	bufp := framePool.Get().(*[]byte)
	b := append((*bufp)[:0], cw.head...)
	cw.head = nil
	if cw.chunked {
		if len(p) > 0 {
			b = strconv.AppendUint(b, uint64(len(p)), 16)
			b = append(b, "\r\n"...)
			b = append(b, p...)
			b = append(b, "\r\n"...)
		}
		if last {
			b = append(b, "0\r\n\r\n"...)
		}
	} else {
		b = append(b, p...)
	}
	var n int
	var err error
	if len(b) > 0 {
		n, err = cw.c.Write(b)
	}
	if cap(b) <= 64<<10 {
		*bufp = b[:0]
		framePool.Put(bufp)
	}
	return n, err
}

// awaitStreams waits, until ctx ends, for the requests in flight (the
// hijacked streams among them, which fasthttp's Shutdown no longer counts)
// to finish.
func (s *Server) awaitStreams(ctx context.Context) {
	for s.live.Load() > 0 && ctx.Err() == nil {
		time.Sleep(5 * time.Millisecond)
	}
}
