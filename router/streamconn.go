package router

import (
	"bytes"
	"context"
	"net"
	"reflect"
	"strconv"
	"sync"
	"time"

	"github.com/valyala/fasthttp"
)

// In PD mode a streaming request's client connection is hijacked before
// its attempts run: fasthttp's connection goroutine (whose stack, deep in
// serveConn, shrank to no less than 16 KiB while it waited for the first
// token) goes back to its pool, and fasthttp's hijack handler, a shallow
// frame, runs the attempts, waits for the first token and writes the head
// and the first event straight to the socket (no 4 KiB connection writer).
// Over h2c it does not wait: the request parks on decode's stream, and
// the handler returns at once (firstwait.go).
// The handler then returns, giving fasthttp its RequestCtx back
// (endStream), and an h2c stream holds no goroutine between events: each
// of its events is written by a goroutine that the h2c connection's reader
// starts (resume); an HTTP/1.1 one goes on on a goroutine of its own
// (relayRest). Stacks stay at 4 KiB while they wait: the frames above the
// waits (startStream's, relay's) are kept small for that, 1,232 bytes at
// the first (the collector halves a stack only while its use, plus 800
// bytes, is under a quarter of it: under 1,248 bytes for 4 KiB;
// TestWaitingStreamStackFitsIn4KiB), and nothing on the way to them needs
// more than 4 KiB (TestOpenStreamStackIs4KiB). Once the response is
// written, the connection waits for its client's next request in the
// shared epoll set, and fasthttp serves it again once it comes
// (KeepHijackedConns: the router closes or serves it; parkconn.go).

// serveStream serves r, a PD streaming request, on its hijacked
// connection. fasthttp hands the connection over unless it is already
// closed (its SetDeadline failed): no peer is then left to answer, and r
// is left unserved, as by a client gone before the handler returned.
func (s *Server) serveStream(ctx *fasthttp.RequestCtx, r *request) {
	ctx.HijackSetNoResponse(true)
	ctx.Hijack(func(hc net.Conn) {
		s.metrics.httpConnections.Inc() // fasthttp counted it out at the hijack
		r.readAhead = readsAhead(hc, r.conn)
		if s.cfg.Manager.UpstreamHTTP2 { // decode may be h2c: its wait for the first token may park
			r.ownCopy(ctx)
		}
		if s.serve(ctx, r) {
			return // parked for its first token: its continuation answers (firstwait.go)
		}
		s.endStream(ctx, r)
	})
}

// endStream answers r on hc and then closes the connection, or has
// fasthttp serve its next requests. Once its first event is out, a PD
// stream goes on without this handler (resume, or relayRest on a
// goroutine of its own), so that fasthttp takes its RequestCtx back as it
// returns: an open stream then holds neither fasthttp's request and
// response (about 3.5 KiB with their buffers) nor this goroutine's stack.
func (s *Server) endStream(ctx *fasthttp.RequestCtx, r *request) {
	keep := s.answerHead(ctx, r) && !r.readAhead
	sr := r.relay
	if sr == nil {
		_, err := ctx.Response.WriteTo(r.conn) // an error, or nothing for a client gone
		s.closeStream(r, err == nil && keep && !r.clientGone())
		return
	}
	sr.startWriter(ctx, r.conn)
	// The first event goes out here, its 32 KiB buffer back to its pool
	// before a goroutine is started: 10,000 first tokens come at once.
	err := sr.writeFirst()
	if err != nil || !r.detach(ctx) {
		s.relayRest(sr, keep, err)
		return
	}
	if sr.leg.resp.h2 != nil {
		sr.keep = keep
		sr.resumeFn = sr.resume // made once: the h2c reader starts it for every event
		sr.resume()             // until the next event is awaited
		return
	}
	go s.relayRest(sr, keep, nil)
}

// resume relays what the worker has sent, and ends the stream after its
// last bytes. Between events an h2c stream holds no goroutine: resume
// returns, and the stream's next bytes (or its end, or its failure) start
// it again on a goroutine of its own (h2cStream.signal). A client slow to
// read keeps that goroutine in its write meanwhile, and its stream's
// window shut (the worker's bytes are read only once written).
func (sr *streamRelay) resume() {
	for {
		if sr.waiting() {
			sr.beforeWait()
			if sr.leg.resp.parkH2C(sr.resumeFn) {
				return
			}
		}
		err := sr.pass(&sr.cw)
		if err != nil || sr.ended {
			if err == nil {
				err = sr.cw.end()
			}
			sr.end(err)
			sr.r.s.closeStream(sr.r, err == nil && sr.keep)
			return
		}
	}
}

// relayRest writes the rest of the stream (none after err, the first
// write's failure) and ends it.
func (s *Server) relayRest(sr *streamRelay, keep bool, err error) {
	s.closeStream(sr.r, sr.serve(err) && keep)
}

// closeStream parks r's connection until its client's next request
// (parkconn.go), or closes it.
func (s *Server) closeStream(r *request, keep bool) {
	if !keep {
		s.closeParked(r.conn)
		return
	}
	// Bytes already read past the request (a pipelining client's) would
	// wake no epoll wait: they are served at once.
	if h := clientHeadConn(r.conn); h != nil && h.rest != nil || !s.inflight.watcher.park(r.conn, s.keepAliveIdle(), s) {
		s.serveParked(r.conn)
	}
}

// serveParked has fasthttp serve c's next requests; c stays counted open
// until fasthttp closes it.
func (s *Server) serveParked(c net.Conn) {
	go s.srv.ServeConn(c) //nolint:errcheck // it closes the connection when done
}

// closeParked closes c, a connection fasthttp has handed over.
func (s *Server) closeParked(c net.Conn) {
	s.metrics.httpConnections.Dec()
	_ = c.Close()
}

// keepAliveIdle is how long fasthttp keeps a connection idle between
// requests (its idleTimeout: IdleTimeout, else ReadTimeout).
func (s *Server) keepAliveIdle() time.Duration {
	if s.srv.IdleTimeout > 0 {
		return s.srv.IdleTimeout
	}
	return s.srv.ReadTimeout
}

// answerHead records r's response and prepares its connection (r.conn,
// which fasthttp's hijacked one wraps) for it; it reports whether the
// connection may serve the client's next request once it is written.
func (s *Server) answerHead(ctx *fasthttp.RequestCtx, r *request) bool {
	s.metrics.observeHTTP("POST", r.path, ctx.Response.StatusCode(), ctx.Response.Header.Peek("X-SMG-Error-Code"), since(r.start))
	// A client that stops reading frees its stream, as fasthttp's
	// WriteTimeout did for the responses it wrote.
	if t := s.srv.WriteTimeout; t > 0 {
		_ = r.conn.SetWriteDeadline(time.Now().Add(t))
	}
	keep := ctx.Request.Header.IsHTTP11() && !ctx.Request.Header.ConnectionClose() && !s.draining.Load()
	if !keep {
		ctx.Response.SetConnectionClose()
	}
	return keep
}

// readsAhead reports whether fasthttp's hijacked connection hc reads
// through a buffer of its own rather than straight from c: bytes a
// pipelining client sent behind the stream's request may wait there, which
// serving c would lose (the connection then closes instead). fasthttp
// keeps that reader unexported; a hijackConn of another shape counts as
// reading ahead.
func readsAhead(hc, c net.Conn) bool {
	v := reflect.ValueOf(hc)
	if v.Kind() != reflect.Pointer || v.Elem().Kind() != reflect.Struct {
		return true
	}
	rd := v.Elem().FieldByName("r")
	if !rd.IsValid() || rd.Kind() != reflect.Interface || rd.IsNil() {
		return true
	}
	inner := rd.Elem()
	return inner.Type() != reflect.TypeOf(c) || inner.Kind() != reflect.Pointer || inner.Pointer() != reflect.ValueOf(c).Pointer()
}

// startWriter sets up the stream's writer on c: its head, in ctx, and its
// framing.
func (sr *streamRelay) startWriter(ctx *fasthttp.RequestCtx, c net.Conn) {
	h := &ctx.Response.Header
	sr.cw = chunkWriter{c: c, chunked: ctx.Request.Header.IsHTTP11()}
	if sr.cw.chunked {
		h.SetContentLength(-1)
	} else { // HTTP/1.0: the body ends with the connection
		h.SetContentLength(-2)
		h.Del(fasthttp.HeaderTransferEncoding)
	}
	sr.cw.head = h.Header()
}

// writeFirst writes the head and the first event, and gives the event's
// buffer back. A head left for later (a stream without a first event)
// gets a copy of its own: ctx may go back to fasthttp first.
func (sr *streamRelay) writeFirst() error {
	if len(sr.pending) == 0 {
		sr.cw.head = bytes.Clone(sr.cw.head)
		return nil
	}
	sr.r.observeFirstByte()
	sr.sent = true
	_, err := sr.cw.Write(sr.pending)
	sr.pending = nil
	if sr.merge == nil {
		sr.releaseBuf()
	}
	return err
}

// serve writes the rest of the stream (none after err, a write's failure)
// and ends it; it reports whether the response went out whole.
func (sr *streamRelay) serve(err error) bool {
	if err == nil {
		err = sr.relay(&sr.cw)
	}
	if err == nil {
		err = sr.cw.end()
	}
	sr.end(err)
	return err == nil
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
// hijacked streams among them, which fasthttp's Shutdown does not count)
// to finish; their connections then close.
func (s *Server) awaitStreams(ctx context.Context) {
	for s.live.Load() > 0 && ctx.Err() == nil {
		time.Sleep(5 * time.Millisecond)
	}
}

// detach makes r independent of ctx, which fasthttp reuses once the
// hijack handler returns: r keeps a copy of its id, its span the status
// the client got, its policy request (whose headers pointed into ctx,
// keeping all of it) drops them, and its PD attempt's body is released (a
// prefill leg not done sending it gets a copy of its own). False, and nothing done,
// while a leg is writing the client's body, or for a vLLM attempt. A
// stream that was parked for its first token was detached then
// (firstwait.go) has its own copy of the body: that goes back to the pool
// here once no leg reads it.
func (r *request) detach(ctx *fasthttp.RequestCtx) bool {
	a := r.relay.attempt
	if r.park != nil {
		r.requestID = bytes.Clone(r.requestID) // it was in the copy
		r.park.over(a.guard.releaseIdle(&a.body))
		r.park, r.body = nil, nil
	} else {
		if a == nil || !a.guard.releaseIdle(&a.body) {
			return false
		}
		r.requestID = bytes.Clone(r.requestID)
		r.policy.Header = nil // policies read it while they select, in the handler
		r.body = nil
	}
	if rt := r.trace; rt != nil {
		rt.status, rt.rctx = ctx.Response.StatusCode(), nil
	}
	return true
}
