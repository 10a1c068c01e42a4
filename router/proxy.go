package router

import (
	"errors"
	"time"

	"github.com/valyala/fasthttp"
	"go.uber.org/zap"

	"github.com/pdrouter/pdrouter/balancer"
	"github.com/pdrouter/pdrouter/router/respond"
	"github.com/pdrouter/pdrouter/router/splice"
)

// generation serves the routed endpoints: validation, admission, then
// attempts (PD or regular) with retries before the first byte is sent.
func (s *Server) generation(ctx *fasthttp.RequestCtx, method, path string, route routeKind) string {
	if method != "POST" {
		respond.RequireMethod(ctx, method, "POST") // the 405
		return path
	}
	if !s.authorized(ctx) {
		return path
	}
	if s.cfg.PDDisaggregation && (route == routeEmbeddings || route == routeClassify || route == routeResponses) {
		writeError(ctx, &apiError{Status: 400, Code: "pd_unsupported_" + route.String(),
			Message: "/" + route.String() + " is not supported in PD disaggregation mode"})
		return path
	}
	r := s.newRequest(ctx, path, route, responseRequestID(ctx))
	if err := splice.Inspect(r.body, &r.info); err != nil {
		r.rec.badPDBody = s.cfg.PDDisaggregation
		writeError(ctx, badRequest("Invalid request body: "+err.Error()))
		r.finish() // after the reply is set: the trace records its status
		return path
	}
	admit, err := s.admission.Acquire(&r.scope)
	if err != nil {
		gone := r.clientGone()
		r.rec.admission = rejected
		switch {
		case errors.Is(err, balancer.ErrQueueTimeout):
			writeError(ctx, &apiError{Status: 408, Code: "queue_timeout", Message: "request timed out waiting in the admission queue"})
		case errors.Is(err, balancer.ErrQueueFull):
			writeError(ctx, &apiError{Status: 429, Code: "rate_limited", Message: "too many requests: the admission queue is full"})
		case !gone:
			// --request-timeout-secs ran out while queued (a queue timeout
			// longer than the request timeout): answer, never an empty 200.
			writeError(ctx, &apiError{Status: 504, Code: "request_timeout", Message: "request timed out waiting in the admission queue"})
		}
		r.finish()
		return path
	}
	r.rec.admission = admitted
	r.admit = admit
	if r.info.Stream && s.cfg.PDDisaggregation {
		s.serveStream(ctx, r) // on its own goroutine (streamconn.go)
		return path
	}
	s.serve(ctx, r)
	return path
}

// responseRequestID is the X-Request-Id setRequestID gave the response,
// looked up by the name it set, without normalizing it again.
func responseRequestID(ctx *fasthttp.RequestCtx) []byte {
	return ctx.Response.Header.PeekCanonical(headerRequestID)
}

func (s *Server) backendType() string {
	if s.cfg.PDDisaggregation {
		return "pd"
	}
	return "regular"
}

// serve runs attempts until one answers or the retry budget is spent. It
// reports whether a PD stream's attempt is parked for its first token: its
// continuation goes on from there (firstwait.go), and r is no longer the
// caller's.
func (s *Server) serve(ctx *fasthttp.RequestCtx, r *request) bool {
	r.rec.model, r.rec.routed = s.modelLabel(r), true
	return s.attempts(ctx, r, 0, nil)
}

// attemptEnd is how an attempt left the request.
type attemptEnd uint8

const (
	attemptEnded     attemptEnd = iota // answered (fail nil) or failed: serve decides what follows
	attemptStreaming                   // a stream writer owns the request
	attemptParked                      // parked for the first token (firstwait.go)
)

// streamingEnd is attemptEnd for the attempts that report a bool.
func streamingEnd(streaming bool) attemptEnd {
	if streaming {
		return attemptStreaming
	}
	return attemptEnded
}

// attempts runs r's attempts from the next'th on (fail: the failure of the
// one before it) and answers the last failure; true when one is parked.
func (s *Server) attempts(ctx *fasthttp.RequestCtx, r *request, next int, fail *apiError) bool {
	for attempt, n := next, s.cfg.Retry.Attempts(); attempt < n; attempt++ {
		r.attempt = attempt
		if attempt > 0 {
			s.backOff(r, attempt)
		}
		if r.scope.Err() != nil {
			break
		}
		var end attemptEnd
		switch {
		case s.cfg.VLLMPDDisaggregation:
			var streaming bool
			fail, streaming = s.vllmAttempt(ctx, r)
			end = streamingEnd(streaming)
		case s.cfg.PDDisaggregation:
			fail, end = s.pdAttempt(ctx, r)
		default:
			var streaming bool
			fail, streaming = s.regularAttempt(ctx, r)
			end = streamingEnd(streaming)
		}
		if end != attemptEnded {
			return end == attemptParked // the stream writer, or the continuation, finishes r
		}
		if !s.retryable(r, fail) {
			break
		}
	}
	s.answerFailure(ctx, r, fail)
	return false
}

// retryable reports whether r's attempt that failed with fail (nil: it
// answered) is followed by another, and records whether it was the last.
func (s *Server) retryable(r *request, fail *apiError) bool {
	if fail == nil || !balancer.Retryable(fail.Status) {
		return false
	}
	attempts := s.cfg.Retry.Attempts()
	r.rec.exhausted = r.attempt == attempts-1 && attempts > 1
	return true
}

// backOff waits before r's attempt, a retry. Apart from serve: a stream's
// goroutine waits for its first token below serve's frame, whose size
// decides the runtime's starting stack size (TestWaitingStreamStackFitsIn4KiB).
func (s *Server) backOff(r *request, attempt int) {
	r.settle()
	backoff := s.cfg.Retry.Backoff(attempt - 1)
	r.rec.backoffs = append(r.rec.backoffs, backoff)
	t := time.NewTimer(backoff)
	select {
	case <-t.C:
	case <-r.scope.Done():
		t.Stop()
	}
}

// answerFailure ends r after its last attempt, answering its failure, if
// any, on ctx (apart from serve: see backOff).
func (s *Server) answerFailure(ctx *fasthttp.RequestCtx, r *request, fail *apiError) {
	defer r.finish()
	if r.clientGone() {
		s.log.Debug("client went away", zap.ByteString("request_id", r.requestID))
		r.rec.fail("client_disconnected")
		return
	}
	if fail := r.ending(fail); fail != nil {
		fail.write(ctx)
	}
}

// ending records how r ends and returns the failure to answer: a timeout
// or the shutdown that ended its scope, else its last attempt's (nil: it
// succeeded).
func (r *request) ending(fail *apiError) *apiError {
	switch r.scope.Cause() {
	case errRequestTimeout:
		fail = &apiError{Status: 504, Code: "request_timeout", Message: "request timed out"}
	case errShuttingDown:
		fail = shuttingDown()
	}
	if fail != nil {
		r.rec.fail(fail.Code)
		return fail
	}
	r.rec.outcome = outcomeSucceeded
	return nil
}

// modelLabel is the request's model when a worker serves it: the label is
// client input, so anything else is "unknown" to keep series bounded.
func (s *Server) modelLabel(r *request) string {
	if !r.info.Model.OK() {
		return "unknown"
	}
	m := splice.FirstString(r.body, r.info.Model)
	for _, w := range s.reg.Snapshot().All {
		if w.ModelID == bstr(m) {
			return w.ModelID
		}
	}
	return "unknown"
}

// sides are the worker types a request touches.
func (s *Server) sides() []balancer.WorkerType {
	if s.cfg.PDDisaggregation {
		return []balancer.WorkerType{balancer.Prefill, balancer.Decode}
	}
	return []balancer.WorkerType{balancer.Regular}
}

func boolLabel(b bool) string {
	if b {
		return "true"
	}
	return "false"
}

// policyRequest gives policies the request's routing text and headers.
// It lives in the request, so a selection allocates nothing for it.
func (s *Server) policyRequest(ctx *fasthttp.RequestCtx, r *request) *balancer.Request {
	r.policy = balancer.Request{Header: r.clientHeaders(ctx)}
	if s.needsText {
		r.policy.Text = string(r.routingText())
		r.policy.Model = string(splice.FirstString(r.body, r.info.Model))
	}
	return &r.policy
}

// clientHeaders are the client's headers as policies see them: ctx's,
// or once r is parked for its first token (ctx gone back to fasthttp) its
// own copy of them, for a retry's selection.
func (r *request) clientHeaders(ctx *fasthttp.RequestCtx) balancer.Headers {
	if r.park != nil {
		return &r.park.header
	}
	return (*clientHeaders)(&ctx.Request.Header)
}

// clientHeaders shows policies the client's headers; valid while the
// handler runs, which is when policies select.
type clientHeaders fasthttp.RequestHeader

func (h *clientHeaders) Get(name string) string {
	return string((*fasthttp.RequestHeader)(h).Peek(name))
}

// routingText is what text-aware policies see (spec §2.1).
func (r *request) routingText() []byte {
	switch r.route {
	case routeGenerate:
		return splice.FirstString(r.body, r.info.Text)
	case routeChat:
		return splice.ChatRoutingText(r.body, r.info.Messages)
	case routeCompletions:
		return splice.FirstString(r.body, r.info.Prompt)
	case routeRerank:
		return splice.FirstString(r.body, r.info.Query)
	}
	return splice.FirstString(r.body, r.info.Text)
}

// pick selects a worker of type t for r, preferring those r has not
// failed on yet.
func (s *Server) pick(snap *balancer.Snapshot, t balancer.WorkerType, r *request, pr *balancer.Request) (*balancer.Worker, *apiError) {
	p := s.policies[t]
	start := r.trace.now()
	avail := snap.Available(t)
	if len(avail) == 0 {
		return nil, selectionError(t.String(), len(snap.ByType[t]))
	}
	avail = r.failed.without(avail)
	pr.Pool = snap.ByType[t] // what X-SMG-Target-Worker indexes, whatever this attempt leaves out
	w, err := p.Select(avail, pr)
	if err != nil || w == nil {
		return nil, &apiError{Status: 503, Code: "server_selection_failed", Message: "No available servers: " + p.Name() + " policy made no selection"}
	}
	r.rec.pick(w)
	r.trace.selected(start, w, p.Name())
	return w, nil
}
