package router

import (
	"context"
	"errors"

	"github.com/valyala/fasthttp"

	"github.com/pdrouter/pdrouter/balancer"
	"github.com/pdrouter/pdrouter/router/splice"
)

// regularAttempt sends the body unchanged to one worker (non-PD mode).
func (s *Server) regularAttempt(ctx *fasthttp.RequestCtx, r *request) (*apiError, bool) {
	w, fail := s.pick(s.reg.Snapshot(), balancer.Regular, r, s.policyRequest(ctx, r))
	if fail != nil {
		return fail, false
	}
	header := r.header
	if w.APIKey != "" { // regular mode authenticates to the worker with its own key
		header = appendHeader(forwardHeaders(nil, ctx, true, r.requestID), []byte("Authorization"), []byte("Bearer "+w.APIKey))
	}
	// Attempts run one after the other: each may reuse the request's body.
	r.out.Reset(r.body)
	if w.DPSize > 0 { // --dp-aware: the rank, as sglang-router 0.3.x names it
		at := splice.FindRanks(r.body, &r.info)
		splice.SetRank(r.out, &at, splice.DataParallelRank, w.DPRank)
	}
	l := &r.leg
	l.open(r, w, s.setRID(r, r.out, batchSize(r.route, r.body, &r.info)))
	if err := l.send(&r.scope, r.path, r.out, header); err != nil {
		l.close()
		if r.clientGone() {
			return nil, false
		}
		if errors.Is(err, context.DeadlineExceeded) {
			return &apiError{Status: 504, Code: "call_upstream_timeout", Message: "Upstream request timed out: " + err.Error()}, false
		}
		return &apiError{Status: 502, Code: "call_upstream_connection_failed", Message: "Failed to reach worker: " + err.Error()}, false
	}
	if status := l.resp.StatusCode; status/100 != 2 {
		// The worker's own error reply is passed through, as sglang-router does.
		e := &apiError{Status: status, Code: "upstream_" + statusLabel(status), raw: readError(l.resp), rawType: l.resp.ContentType()}
		l.close()
		return e, false
	}
	return s.reply(ctx, r, l, nil)
}
