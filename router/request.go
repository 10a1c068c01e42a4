package router

import (
	"context"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/pdrouter/pdrouter/balancer"
	"github.com/pdrouter/pdrouter/router/splice"
)

// request is one client request on its way through the router.
type request struct {
	s         *Server
	route     routeKind
	readAhead bool // PD stream: fasthttp's hijacked connection read past the request (readsAhead)
	path      string
	body      []byte // the client's body: fasthttp's buffer, valid until the response is written
	info      splice.Info
	start     time.Time
	requestID []byte
	header    []byte // forwarded header lines, "Name: value\r\n" each
	// headerSpace holds the usual header lines (only X-Request-Id) without
	// an allocation of their own.
	headerSpace [64]byte

	// scope ends when the client goes away, at the request timeout or at
	// hard shutdown. It lives until the handler and every leg it started
	// are done (refs), because a prefill leg may outlive its handler.
	scope scope // embedded: no allocation of its own
	refs  atomic.Int32
	// pins counts who may still touch the request's memory: one for its
	// life (refs above zero), one for each sweeper cancel and engine abort
	// under way, which outlive neither their lock nor their goroutine but
	// may outlive its life. The last unpin recycles a regular request.
	pins   atomic.Int32
	whole  *regularRequest // regular mode: the pooled allocation r lives in
	admit  func()          // returns the admission token
	leg    leg             // the worker leg whose reply is the client's (decode in PD mode)
	relay  *streamRelay    // the stream to write, once an attempt has started one
	policy balancer.Request
	conn   net.Conn

	track tracking // the inflight tracker's, guarded by its lock

	rec    record        // what it did, emitted once when it ends (record.go)
	failed failedWorkers // workers this request's legs failed on (leg.go)
	trace  *reqTrace     // nil unless traced (trace.go)

	// attempt counts the tries; each has its own rid (abort.go). A retry
	// first waits for the failed try's prefill leg (prev) and the engine
	// aborts its legs sent (aborts): settle.
	attempt int
	prev    *attempt
	aborts  sync.WaitGroup

	// out is what a regular-mode attempt sends: the client's body and the
	// rid. It points into regularRequest: PD attempts have their own (prefill
	// may outlive an attempt), and a PD stream keeps its request open, so
	// its 432 bytes are not in request itself.
	out *splice.Body

	park *firstWait // a PD stream parked for its first token, until it is out (firstwait.go)
}

// regularRequest is a regular-mode request and its out, one allocation,
// pooled: it was a regular request's only allocation, and with the GC it
// drove it cost 1.6–2.5 µs of CPU per request. PD requests are not pooled:
// a PD stream keeps its request for its whole length, and each try
// allocates an attempt anyway.
type regularRequest struct {
	request
	out splice.Body
}

var regularRequests = sync.Pool{New: func() any { return new(regularRequest) }}

// newRequest keeps the client's body in place, and legs send it from there
// (splice.Body): it is valid until the response is written, a stream's
// included. A prefill leg may outlive that, so it writes the body under its
// attempt's guard (releaseBody); the header lines are a copy.
func (s *Server) newRequest(ctx *fasthttp.RequestCtx, path string, route routeKind, requestID []byte) *request {
	var r *request
	if s.cfg.PDDisaggregation {
		r = &request{}
	} else {
		rr := regularRequests.Get().(*regularRequest) // zeroed by recycle
		r = &rr.request
		r.out, r.whole = &rr.out, rr
	}
	r.s, r.route, r.path, r.start, r.requestID = s, route, path, time.Now(), requestID
	r.body = ctx.PostBody()
	r.header = forwardHeaders(r.headerSpace[:0], ctx, false, requestID)
	// The request timeout, the disconnect watch and hard shutdown all come
	// from the inflight tracker, so the scope needs no parent.
	r.conn = ctx.Conn()
	r.refs.Store(1)
	r.pins.Store(1)
	s.live.Add(1)
	s.inflight.add(r)
	r.trace = s.trace.start(ctx, r)
	return r
}

func (r *request) hold() { r.refs.Add(1) }

// release drops one reference; the last one emits the request's record
// and ends its context.
func (r *request) release() {
	if r.refs.Add(-1) == 0 {
		r.emit()
		r.s.inflight.remove(r)
		r.cancel(context.Canceled)
		r.s.live.Add(-1)
		r.unpin()
	}
}

// pin keeps r's memory from reuse. Only a holder that knows r's life (or
// another pin) has not ended yet may take one: the inflight tracker under
// its lock, a leg before it closes.
func (r *request) pin() { r.pins.Add(1) }

// unpin drops a pin; with the last, nothing can touch r any more, and a
// regular request goes back to the pool, zeroed: no field of this request
// may reach the next one, nor keep what it points to alive meanwhile.
func (r *request) unpin() {
	if r.pins.Add(-1) == 0 && r.whole != nil {
		rr := r.whole
		*rr = regularRequest{}
		regularRequests.Put(rr)
	}
}

// finish is called once when the response to the client is complete.
func (r *request) finish() {
	r.rec.responded(r)
	r.s.inflight.finished(r)
	if r.admit != nil {
		r.admit()
	}
	r.release()
}

// cancel ends the request's scope, and with it every leg.
func (r *request) cancel(cause error) { r.scope.cancel(cause) }

// clientLeft is the disconnect watch's verdict.
func (r *request) clientLeft() { r.cancel(errClientGone) }

func (r *request) clientGone() bool { return r.scope.Cause() == errClientGone }

// settle returns once the legs of the failed attempt are closed and their
// engines have answered the aborts (each bounded by --abort-timeout), so
// that no abort of it can reach the next.
func (r *request) settle() {
	if r.prev != nil {
		<-r.prev.done
		r.prev = nil
	}
	r.aborts.Wait()
}

// observeFirstByte records the router-side time to first byte.
func (r *request) observeFirstByte() {
	r.rec.firstByte = time.Since(r.start)
	r.leg.trace.firstByte(r.info.Stream)
}
