package router

import (
	"context"
	"errors"

	"github.com/valyala/fasthttp"

	"github.com/pdrouter/pdrouter/balancer"
)

// regularAttempt sends the body unchanged to one worker (non-PD mode).
func (s *Server) regularAttempt(ctx *fasthttp.RequestCtx, r *request) (*apiError, bool) {
	w, fail := s.pick(s.prefill, s.reg.Snapshot(), balancer.Regular, s.policyRequest(ctx, r))
	if fail != nil {
		return fail, false
	}
	header := r.header
	if w.APIKey != "" { // regular mode authenticates to the worker with its own key
		header = appendHeader(forwardHeaders(nil, ctx, true), []byte("Authorization"), []byte("Bearer "+w.APIKey))
	}
	w.IncLoad()
	resp, err := s.post(&r.scope, w, r.path, r.body, header)
	if err != nil {
		w.DecLoad()
		if r.clientGone() {
			return nil, false
		}
		w.Breaker.Record(false)
		s.bm.WorkerError(w, "connect")
		if errors.Is(err, context.DeadlineExceeded) {
			return &apiError{Status: 504, Code: "call_upstream_timeout", Message: "Upstream request timed out: " + err.Error()}, false
		}
		return &apiError{Status: 502, Code: "call_upstream_connection_failed", Message: "Failed to reach worker: " + err.Error()}, false
	}
	w.Breaker.Record(isSuccess(resp.StatusCode, false))
	if resp.StatusCode/100 != 2 {
		// The worker's own error reply is passed through, as sglang-router does.
		s.bm.WorkerError(w, "status_"+statusLabel(resp.StatusCode))
		e := &apiError{Status: resp.StatusCode, Code: "upstream_" + statusLabel(resp.StatusCode), raw: readError(resp), rawType: resp.ContentType()}
		resp.Close()
		w.DecLoad()
		return e, false
	}
	if r.info.Stream {
		return s.startStream(ctx, r, resp, w, nil)
	}
	defer w.DecLoad()
	defer resp.Close()
	if err := readReply(ctx, resp); err != nil {
		if r.clientGone() {
			return nil, false
		}
		return &apiError{Status: 500, Code: "read_response_failed", Message: "Failed to read worker response: " + err.Error()}, false
	}
	r.observeFirstByte()
	return nil, false
}
