package router

import (
	"container/list"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/valyala/fasthttp"

	"github.com/pdrouter/pdrouter/balancer"
	"github.com/pdrouter/pdrouter/router/splice"
)

// errClientGone cancels upstream legs when the client disconnects.
var errClientGone = errors.New("client disconnected")

// request is one client request on its way through the router.
type request struct {
	s         *Server
	route     routeKind
	path      string
	body      []byte // the client's body: fasthttp's buffer, valid until the handler returns
	info      splice.Info
	start     time.Time
	requestID []byte
	header    []byte // forwarded header lines, "Name: value\r\n" each
	// headerSpace holds the usual header lines (only X-Request-Id) without
	// an allocation of their own.
	headerSpace [64]byte

	// ctx ends when the client goes away, at the request timeout or at hard
	// shutdown. It lives until the handler and every leg it started are
	// done (refs), because a prefill leg may outlive its handler.
	ctx     scope // embedded: no allocation of its own
	refs    atomic.Int32
	admit   func() // returns the admission token
	policy  balancer.Request
	metrics *routeMetrics // this route's series, set when routing starts
	conn    net.Conn

	// Guarded by the server's inflight tracker.
	watch     *connWatcher  // started once the request is watchDelay old
	responded bool          // the response is complete: no watch may start
	released  bool          // the last reference is gone
	long      *list.Element // its place in the tracker's long list, if there
}

// errRequestTimeout ends a request at --request-timeout-secs; it is a
// context.DeadlineExceeded so callers can tell a timeout from a failure.
var errRequestTimeout = fmt.Errorf("request timed out: %w", context.DeadlineExceeded)

// newRequest keeps the client's body in place: everything that outlives the
// handler (a prefill leg, a stream) uses its own copies (the injected body,
// the header lines), so fasthttp may reuse its buffer afterwards.
func (s *Server) newRequest(ctx *fasthttp.RequestCtx, path string, route routeKind, requestID []byte) *request {
	r := &request{s: s, route: route, path: path, start: time.Now(), requestID: requestID}
	r.body = ctx.PostBody()
	r.header = forwardHeaders(r.headerSpace[:0], ctx, false)
	// The request timeout, the disconnect watch and hard shutdown all come
	// from the inflight tracker, so the scope needs no parent.
	r.conn = ctx.Conn()
	r.refs.Store(1)
	s.inflight.add(r)
	return r
}

func (r *request) hold() { r.refs.Add(1) }

// release drops one reference; the last one ends the request's context.
func (r *request) release() {
	if r.refs.Add(-1) == 0 {
		r.s.inflight.remove(r)
		r.cancel(context.Canceled)
	}
}

// finish is called once when the response to the client is complete.
func (r *request) finish() {
	r.s.inflight.finished(r).stop()
	if r.admit != nil {
		r.admit()
	}
	r.release()
}

// cancel ends the request's scope, and with it every leg.
func (r *request) cancel(cause error) { r.ctx.cancel(cause) }

// clientLeft is the disconnect watch's verdict.
func (r *request) clientLeft() { r.cancel(errClientGone) }

func (r *request) clientGone() bool { return r.ctx.Cause() == errClientGone }

// forwardHeaders renders sglang-router's whitelist of client headers as
// header lines, once per request (both legs and retries reuse them).
// skipAuth leaves out the client's Authorization (regular mode sends the
// worker's own key instead).
func forwardHeaders(b []byte, ctx *fasthttp.RequestCtx, skipAuth bool) []byte {
	for k, v := range ctx.Request.Header.All() {
		name := bstr(k)
		switch {
		case strings.EqualFold(name, "authorization"):
			if skipAuth {
				continue
			}
		case strings.EqualFold(name, "x-correlation-id"), strings.EqualFold(name, "traceparent"),
			strings.EqualFold(name, "tracestate"), strings.EqualFold(name, "x-smg-routing-key"),
			len(name) > 13 && strings.EqualFold(name[:13], "x-request-id-"):
		default:
			continue
		}
		b = appendHeader(b, k, v)
	}
	return appendHeader(b, []byte("X-Request-Id"), ctx.Response.Header.Peek("x-request-id"))
}

func appendHeader(b, name, value []byte) []byte {
	b = append(b, name...)
	b = append(b, ": "...)
	b = append(b, value...)
	return append(b, "\r\n"...)
}

// post sends body to w. The caller closes the response.
func (s *Server) post(ctx *scope, w *balancer.Worker, path string, body, header []byte) (*upstreamResponse, error) {
	return s.hot.post(ctx, w.URL, path, body, header)
}

// maxErrorBody bounds what is read of an upstream error reply.
const maxErrorBody = 64 << 10

func readError(resp *upstreamResponse) []byte {
	b, _ := io.ReadAll(io.LimitReader(resp, maxErrorBody))
	return b
}

// hopHeaders are not copied from a worker's reply; fasthttp sets its own
// framing headers.
var hopHeaders = map[string]bool{
	"Connection": true, "Keep-Alive": true, "Proxy-Authenticate": true, "Proxy-Authorization": true,
	"Te": true, "Trailer": true, "Trailers": true, "Transfer-Encoding": true, "Upgrade": true,
	"Content-Encoding": true, "Host": true, "Content-Length": true, "Date": true, "Server": true,
	"X-Request-Id": true,
}

func copyHeaders(ctx *fasthttp.RequestCtx, resp *upstreamResponse) {
	for k, v := range resp.Header.All() {
		if !hopHeaders[bstr(k)] {
			ctx.Response.Header.AddBytesKV(k, v)
		}
	}
}

// bstr views bytes as a string without copying, for comparisons only.
func bstr(b []byte) string { return unsafe.String(unsafe.SliceData(b), len(b)) }

// chunkPool holds the buffers streams are relayed through.
var chunkPool = sync.Pool{New: func() any { b := make([]byte, 32<<10); return &b }}

// isSuccess is the breaker outcome: PD counts 4xx as success (the worker
// answered; the client was wrong), regular mode only 2xx.
func isSuccess(status int, pd bool) bool {
	return status/100 == 2 || (pd && status/100 == 4)
}
