package router

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
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
	body      []byte // the client's body, owned by the request
	info      splice.Info
	start     time.Time
	requestID []byte
	header    http.Header // forwarded to workers

	// ctx ends when the client goes away, at the request timeout or at hard
	// shutdown. It lives until the handler and every leg it started are
	// done (refs), because a prefill leg may outlive its handler.
	ctx    context.Context
	cancel context.CancelCauseFunc
	refs   atomic.Int32
	watch  *connWatcher
	admit  func() // returns the admission token
}

// newRequest copies what it needs out of ctx: fasthttp reuses its buffers
// once the handler returns, and upstream legs may run longer.
func (s *Server) newRequest(ctx *fasthttp.RequestCtx, path string, route routeKind, requestID []byte) *request {
	r := &request{s: s, route: route, path: path, start: time.Now(), requestID: requestID}
	r.body = append([]byte(nil), ctx.PostBody()...)
	r.header = forwardHeaders(ctx)
	base, cancelTimeout := context.WithTimeout(s.base, s.cfg.RequestTimeout)
	r.ctx, r.cancel = context.WithCancelCause(base)
	context.AfterFunc(r.ctx, cancelTimeout)
	r.refs.Store(1)
	r.watch = watchConn(ctx.Conn(), func() { r.cancel(errClientGone) })
	return r
}

func (r *request) hold() { r.refs.Add(1) }

// release drops one reference; the last one ends the request's context.
func (r *request) release() {
	if r.refs.Add(-1) == 0 {
		r.cancel(context.Canceled)
	}
}

// finish is called once when the response to the client is complete.
func (r *request) finish() {
	r.watch.stop()
	if r.admit != nil {
		r.admit()
	}
	r.release()
}

func (r *request) clientGone() bool { return context.Cause(r.ctx) == errClientGone }

// forwardHeaders keeps sglang-router's whitelist of client headers.
func forwardHeaders(ctx *fasthttp.RequestCtx) http.Header {
	h := make(http.Header, 4)
	h.Set("Content-Type", "application/json")
	for k, v := range ctx.Request.Header.All() {
		name := strings.ToLower(bstr(k))
		switch {
		case name == "authorization", name == "x-correlation-id", name == "traceparent",
			name == "tracestate", name == "x-smg-routing-key", strings.HasPrefix(name, "x-request-id-"):
			h.Set(name, string(v))
		}
	}
	h.Set("X-Request-Id", string(ctx.Response.Header.Peek("x-request-id")))
	h.Set("User-Agent", "") // send none, as sglang-router sends only whitelisted headers
	return h
}

// post sends body to w. The caller closes the response body.
func (s *Server) post(ctx context.Context, w *balancer.Worker, path string, body []byte, header http.Header) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, w.URL+path, bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	req.Header = header
	return s.upstream.Do(req)
}

// maxErrorBody bounds what is read of an upstream error reply.
const maxErrorBody = 64 << 10

func readError(resp *http.Response) []byte {
	b, _ := io.ReadAll(io.LimitReader(resp.Body, maxErrorBody))
	return b
}

// hopHeaders are not copied from a worker's reply; fasthttp sets its own
// framing headers.
var hopHeaders = map[string]bool{
	"Connection": true, "Keep-Alive": true, "Proxy-Authenticate": true, "Proxy-Authorization": true,
	"Te": true, "Trailer": true, "Trailers": true, "Transfer-Encoding": true, "Upgrade": true,
	"Content-Encoding": true, "Host": true, "Content-Length": true, "Date": true, "Server": true,
}

func copyHeaders(ctx *fasthttp.RequestCtx, h http.Header) {
	for k, vs := range h {
		if hopHeaders[k] || k == "X-Request-Id" {
			continue
		}
		for _, v := range vs {
			ctx.Response.Header.Add(k, v)
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
