package router

import (
	"io"

	"github.com/valyala/fasthttp"

	"github.com/pdrouter/pdrouter/balancer"
	"github.com/pdrouter/pdrouter/router/splice"
)

// The PD request path, top to bottom:
//
//  1. pick a prefill and a decode worker with each side's policy;
//  2. splice bootstrap_host/port/room into the body bytes (inject.go);
//  3. send the same body to both at once;
//  4. relay decode's answer as it arrives, never waiting for prefill's body
//     (unlike sglang-router, sgl-project/sglang#22853), while a goroutine
//     watches prefill: if prefill fails, decode is cancelled and the client
//     gets prefill's error (before the first byte) or an SSE error frame
//     (after it);
//  5. a client that goes away cancels both legs (connwatch.go, stream.go).

// prefillLeg is the prefill request running beside decode, with the
// attempt's scope (one allocation for both).
type prefillLeg struct {
	actx scope // ends both legs: prefill failed, or the attempt is over
	done chan struct{}
	err  *apiError // set before done closes when prefill failed
	body []byte    // prefill's reply, kept only for logprob merging
}

// failure returns prefill's error if prefill is what ended the attempt.
func (p *prefillLeg) failure() *apiError {
	if p.actx.Cause() != errPrefillFailed {
		return nil
	}
	<-p.done
	return p.err
}

// wait blocks until prefill has answered or the attempt ends.
func (p *prefillLeg) wait() bool {
	select {
	case <-p.done:
		return p.err == nil
	case <-p.actx.Done():
		return false
	}
}

// pdAttempt runs one try on a fresh pair and room. It returns the failure to
// report (nil when a reply was written) and whether a stream writer now owns
// the request.
func (s *Server) pdAttempt(ctx *fasthttp.RequestCtx, r *request) (*apiError, bool) {
	snap := s.reg.Snapshot()
	pr := s.policyRequest(ctx, r)
	pw, fail := s.pick(s.prefill, snap, balancer.Prefill, pr)
	if fail != nil {
		return fail, false
	}
	dw, fail := s.pick(s.decode, snap, balancer.Decode, pr)
	if fail != nil {
		return fail, false
	}
	port := pw.BootstrapPort
	if port == balancer.NoBootstrapPort {
		port = splice.NoPort
	}
	body, _ := splice.AppendBootstrap(make([]byte, 0, len(r.body)+192), r.body, &r.info, pw.BootstrapHost, port,
		batchSize(r.route, r.body, &r.info))

	leg := &prefillLeg{done: make(chan struct{})}
	actx := &leg.actx
	actx.inherit(&r.scope)
	pw.IncLoad()
	dw.IncLoad()
	r.hold()
	s.background.Add(1)
	go s.runPrefillLeg(leg, pw, r, body)

	resp, err := s.post(actx, dw, r.path, body, r.header)
	if err != nil {
		dw.DecLoad()
		if f := leg.failure(); f != nil {
			return f.forStream(r.info.Stream), false
		}
		actx.cancel(errAttemptOver)
		if r.clientGone() {
			return nil, false
		}
		dw.Breaker.Record(false)
		s.bm.WorkerError(dw, "connect")
		return &apiError{Status: 502, Code: "decode_server_error", Message: "Decode server error: " + err.Error()}, false
	}
	dw.Breaker.Record(isSuccess(resp.StatusCode, true))
	if resp.StatusCode/100 != 2 {
		eb := readError(resp)
		resp.Close()
		dw.DecLoad()
		actx.cancel(errAttemptOver)
		s.bm.WorkerError(dw, "status_"+statusLabel(resp.StatusCode))
		e := upstreamError("decode", resp.StatusCode, eb)
		if r.info.Stream {
			e.Status, e.sse = resp.StatusCode, true
		}
		return e, false
	}
	if r.info.Stream {
		return s.startStream(ctx, r, resp, dw, leg)
	}
	defer dw.DecLoad()
	defer resp.Close()
	if err := readReply(ctx, resp); err != nil {
		if f := leg.failure(); f != nil {
			return f, false
		}
		actx.cancel(errAttemptOver)
		if r.clientGone() {
			return nil, false
		}
		return &apiError{Status: 500, Code: "read_response_failed", Message: "Failed to read decode response: " + err.Error()}, false
	}
	if r.mergeLogprobs() && leg.wait() {
		ctx.SetBody(mergeLogprobsJSON(leg.body, ctx.Response.Body()))
	}
	r.observeFirstByte()
	return nil, false
}

// runPrefillLeg runs the prefill leg on its own goroutine (a method with
// arguments rather than a closure: nothing to allocate for it).
func (s *Server) runPrefillLeg(leg *prefillLeg, pw *balancer.Worker, r *request, body []byte) {
	defer s.background.Done()
	defer r.release()
	defer pw.DecLoad()
	defer close(leg.done)
	leg.err, leg.body = s.runPrefill(&leg.actx, pw, r, body)
	if leg.err != nil {
		leg.actx.cancel(errPrefillFailed)
	}
}

// runPrefill sends the prefill leg and reads its reply. An error caused by
// the attempt ending for another reason is not a prefill failure.
func (s *Server) runPrefill(ctx *scope, pw *balancer.Worker, r *request, body []byte) (*apiError, []byte) {
	resp, err := s.post(ctx, pw, r.path, body, r.header)
	if err != nil {
		if ctx.Err() != nil {
			return nil, nil
		}
		pw.Breaker.Record(false)
		s.bm.WorkerError(pw, "connect")
		return &apiError{Status: 502, Code: "prefill_server_error",
			Message: "Prefill server error: " + err.Error() + ". This will cause decode timeout."}, nil
	}
	defer resp.Close()
	pw.Breaker.Record(isSuccess(resp.StatusCode, true))
	if resp.StatusCode/100 != 2 {
		s.bm.WorkerError(pw, "status_"+statusLabel(resp.StatusCode))
		return upstreamError("prefill", resp.StatusCode, readError(resp)), nil
	}
	var out []byte
	if r.mergeLogprobs() {
		out, err = io.ReadAll(resp)
	} else {
		_, err = io.Copy(io.Discard, resp)
	}
	if err != nil && ctx.Err() == nil {
		return &apiError{Status: 502, Code: "prefill_server_error", Message: "Prefill server error: " + err.Error()}, nil
	}
	return nil, out
}

// readReply makes a worker's complete reply the client's: status, headers,
// and the body read into the response's own (pooled) buffer.
func readReply(ctx *fasthttp.RequestCtx, resp *upstreamResponse) error {
	ctx.Response.ResetBody()
	bufp := chunkPool.Get().(*[]byte)
	defer chunkPool.Put(bufp)
	for {
		n, err := resp.Read(*bufp)
		ctx.Response.AppendBody((*bufp)[:n])
		if err == io.EOF {
			break
		}
		if err != nil {
			ctx.Response.ResetBody()
			return err
		}
	}
	ctx.SetStatusCode(resp.StatusCode)
	copyHeaders(ctx, resp)
	return nil
}

// batchSize is the number of prompts in a request for bootstrap purposes:
// 1 unless the body is a batch (spec §2.2), improved where upstream is wrong:
// a completions prompt that is one list of token ids is a single prompt.
func batchSize(route routeKind, body []byte, info *splice.Info) int {
	switch route {
	case routeGenerate:
		if info.InputIDs.OK() {
			if n, allArrays := splice.ArrayLen(body, info.InputIDs); allArrays {
				return n
			}
		}
		if info.Text.OK() && body[info.Text.Start] == '[' {
			if n, _ := splice.ArrayLen(body, info.Text); n > 0 {
				return n
			}
		}
	case routeChat:
		if info.N > 1 {
			return int(info.N)
		}
	case routeCompletions:
		if info.Prompt.OK() && body[info.Prompt.Start] == '[' {
			n, allArrays := splice.ArrayLen(body, info.Prompt)
			if n > 0 && (allArrays || splice.FirstString(body, info.Prompt) != nil) {
				return n
			}
		}
	}
	return 1
}
