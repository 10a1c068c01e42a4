package router

import (
	"io"
	"sync"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/pdrouter/pdrouter/balancer"
	"github.com/pdrouter/pdrouter/router/splice"
)

// The PD request path, top to bottom (pdAttempt):
//
//  1. pick a prefill and a decode worker with each side's policy;
//  2. splice bootstrap_host/port/room into the body bytes (splice/);
//  3. send the prefill leg; if it fails, the decode leg is cancelled and
//     the client gets prefill's error (before the first byte) or an SSE
//     error frame (after it);
//  4. send the decode leg with the same body, at once, not after prefill;
//     a non-streamed request over HTTP/1.1 writes both legs from the
//     handler and reads prefill's reply there too when it comes within
//     prefillQuickAnswer (sendBoth), any other watches prefill on a
//     goroutine of its own;
//  5. reply with decode's answer as it arrives (reply.go, stream.go),
//     never waiting for prefill's body (unlike sglang-router,
//     sgl-project/sglang#22853) except to merge logprobs.
//
// A client that goes away cancels both legs (connwatch.go, stream.go).

// pdAttempt runs one try on a fresh pair and room. It returns the failure to
// report (nil when a reply was written) and how the attempt left the
// request: a stream writer may own it now, or, for a stream whose decode
// leg waits for its first token over h2c, a continuation (firstwait.go).
func (s *Server) pdAttempt(ctx *fasthttp.RequestCtx, r *request) (*apiError, attemptEnd) {
	pw, dw, fail := s.pickPair(ctx, r)
	if fail != nil {
		return fail, attemptEnded
	}
	r.rec.startPD()
	a := s.newAttempt(r, pw, dw)
	var ok bool
	if r.info.Stream || pw.HTTP2 || dw.HTTP2 {
		s.startPrefill(r, a)
		fail, ok = s.openDecode(r, a, dw)
	} else {
		fail, ok = s.sendBoth(r, a, dw)
	}
	if ok && r.info.Stream && s.parkFirstToken(r, a) {
		return nil, attemptParked
	}
	streaming := false
	if ok {
		fail, streaming = s.reply(ctx, r, &r.leg, a)
	}
	return r.attemptOver(a, fail, streaming)
}

// attemptOver ends a PD attempt whose reply began (streaming) or failed
// with fail: pdAttempt's end, and a parked stream's once its first bytes
// are in.
func (r *request) attemptOver(a *attempt, fail *apiError, streaming bool) (*apiError, attemptEnd) {
	if streaming {
		return fail, attemptStreaming
	}
	a.releaseBody()
	if fail != nil { // a retry may follow: the prefill leg ends first
		a.abandon()
		r.prev = a
	}
	return fail, attemptEnded
}

// pickPair chooses one worker of each side from one registry snapshot.
func (s *Server) pickPair(ctx *fasthttp.RequestCtx, r *request) (pw, dw *balancer.Worker, fail *apiError) {
	snap := s.reg.Snapshot()
	pr := s.policyRequest(ctx, r)
	if pw, fail = s.pick(snap, balancer.Prefill, r, pr); fail != nil {
		return nil, nil, fail
	}
	dw, fail = s.pick(snap, balancer.Decode, r, pr)
	return pw, dw, fail
}

// bootstrapBody makes a.body the client's body with pw's bootstrap
// fields, a fresh room and the rid (abort.go), which both legs send. It
// holds only the edits: the rest is written from the client's buffer.
func (s *Server) bootstrapBody(r *request, a *attempt, pw, dw *balancer.Worker) {
	port := pw.BootstrapPort
	if port == balancer.NoBootstrapPort {
		port = splice.NoPort
	}
	batch := batchSize(r.route, r.body, &r.info)
	a.body.Reset(r.body)
	splice.SetBootstrap(&a.body, &r.info, pw.BootstrapHost, port, batch)
	a.rid = s.setRID(r, &a.body, batch)
	if pw.DPSize > 0 || dw.DPSize > 0 {
		a.setRanks(r, pw, dw)
	}
}

// setRanks gives the legs the DP ranks of their workers (--dp-aware) as smg
// does (pd_router.rs): prefill's as routed_dp_rank to prefill; decode's as
// routed_dp_rank and prefill's as disagg_prefill_dp_rank (where decode
// fetches the KV from) to decode, in a body of its own that shares the
// bootstrap fields and rid. Done before prefill starts writing its body.
func (a *attempt) setRanks(r *request, pw, dw *balancer.Worker) {
	a.decode = new(splice.Body)
	a.body.CopyTo(a.decode)
	at := splice.FindRanks(r.body, &r.info)
	if pw.DPSize > 0 {
		splice.SetRank(&a.body, &at, splice.RoutedDPRank, pw.DPRank)
		splice.SetRank(a.decode, &at, splice.DisaggPrefillDPRank, pw.DPRank)
	}
	if dw.DPSize > 0 {
		splice.SetRank(a.decode, &at, splice.RoutedDPRank, dw.DPRank)
	}
}

// attempt is one PD try: the scope both legs run under and the prefill leg
// running beside decode (one allocation for all; the decode leg is the
// request's). Its methods are no-ops on nil, which is regular mode.
type attempt struct {
	scope   scope // ends both legs: prefill failed, or the attempt is over
	prefill leg
	done    chan struct{} // closed when the prefill leg has ended (closedDone: it had)
	err     *apiError     // set before done closes when prefill failed
	logp    []byte        // prefill's reply, kept only for logprob merging
	rid     engineRID     // both legs'
	start   time.Time     // when the prefill leg was sent
	kv      kvReport      // the KV transfer time a reply reports (record.go)

	// body is what both legs send. Its segments are the client's buffer,
	// which fasthttp reuses once the response is complete: prefill writes
	// it under guard, which releaseBody takes back.
	body  splice.Body
	guard writeGuard
	// headed, made for streams only, is closed once prefill's reply head
	// is in (headOK: a 2xx) or its send failed (prefillVerdict). headOK
	// sits in guard's padding: an open stream keeps its attempt.
	headOK bool
	headed chan struct{}
	decode *splice.Body // decode's own body when the legs carry DP ranks; nil: body

	// r is the request (its record is the prefill leg goroutine's too);
	// dw and decodeFailed are sendBoth's, for afterWrite: the decode
	// worker and the decode leg's write failure.
	r            *request
	dw           *balancer.Worker
	decodeFailed error
}

// newAttempt opens the prefill leg of a fresh attempt on pw.
func (s *Server) newAttempt(r *request, pw, dw *balancer.Worker) *attempt {
	a := &attempt{r: r, start: r.rec.pdStart}
	s.bootstrapBody(r, a, pw, dw)
	a.scope.inherit(&r.scope)
	a.prefill.open(r, pw, a.rid)
	a.prefill.guard = &a.guard
	return a
}

// closedDone is the done of an attempt whose prefill leg ended on the
// handler's goroutine: nothing to allocate or close for it.
var closedDone = func() chan struct{} {
	c := make(chan struct{})
	close(c)
	return c
}()

// startPrefill runs the prefill leg (or the rest of it) on its own
// goroutine; it holds a reference to r, since it may outlive the handler.
func (s *Server) startPrefill(r *request, a *attempt) {
	a.done = make(chan struct{})
	r.hold()
	s.background.Add(1)
	if r.info.Stream {
		a.headed = make(chan struct{})
	}
	go s.runPrefill(a, r)
}

// runPrefill is the prefill leg's goroutine (a method with arguments rather
// than a closure: nothing to allocate for it).
func (s *Server) runPrefill(a *attempt, r *request) {
	defer s.background.Done()
	defer r.release()
	defer close(a.done)
	a.prefillOver(a.readPrefill(r))
}

// prefillOver ends the prefill leg with its outcome. The leg closes before
// its failure cancels the attempt, so that its connection may be pooled,
// and before done, so that its breaker has heard of it when the client
// does.
func (a *attempt) prefillOver(err *apiError, logp []byte) {
	a.err, a.logp = err, logp
	if a.err == nil && a.scope.Err() == nil {
		a.r.rec.prefilled(time.Since(a.start))
	}
	a.prefill.close()
	if a.err != nil {
		a.scope.cancel(errPrefillFailed)
	}
}

// sendBoth is startPrefill and openDecode for a non-streamed request over
// HTTP/1.1, without a goroutine where it can: the handler writes both legs,
// then reads prefill's reply, which SGLang's prefill sends whole before
// decode can answer (decode needs its KV), and then decode's; a prefill
// reply begun is read to its end here. A prefill silent for
// prefillQuickAnswer is watched from a goroutine after all, so that
// decode's reply is never held for a prefill that is late.
func (s *Server) sendBoth(r *request, a *attempt, dw *balancer.Worker) (*apiError, bool) {
	p, d := &a.prefill, &r.leg
	a.done = closedDone // the prefill leg ends here, unless startPrefill takes it
	a.dw = dw           // for afterWrite, which writes the decode leg
	quick, err := p.writeWait(&a.scope, r.path, &a.body, r.header, a, prefillQuickAnswer)
	if err != nil {
		a.prefillOver(a.sendFailed(err), nil)
		return a.err, false // nil when the scope ended: serve says why
	}
	if err := a.decodeFailed; err != nil {
		d.close()
		a.abandon()
		p.close()
		if r.clientGone() {
			return nil, false
		}
		return decodeSendError(err), false
	}
	if !quick {
		s.startPrefill(r, a)
		return s.decodeReply(r, a, d.await())
	}
	a.prefillOver(a.readPrefill(r))
	if a.err != nil {
		d.close()
		return a.err, false
	}
	return s.decodeReply(r, a, d.await())
}

// afterWrite opens and writes the decode leg once sendBoth has written
// prefill's request, before it waits for prefill's reply.
func (a *attempt) afterWrite() bool {
	r, d := a.r, &a.r.leg
	d.open(r, a.dw, a.rid)
	a.decodeFailed = d.write(&a.scope, r.path, a.decodeBody(), r.header)
	return a.decodeFailed == nil
}

// readPrefill sends the prefill leg and reads its reply. An error caused by
// the attempt ending for another reason is not a prefill failure.
func (a *attempt) readPrefill(r *request) (*apiError, []byte) {
	l := &a.prefill
	err := l.send(&a.scope, r.path, &a.body, r.header)
	if a.headed != nil {
		a.headOK = err == nil && l.resp.StatusCode/100 == 2
		close(a.headed)
	}
	if err != nil {
		return a.sendFailed(err), nil
	}
	if status := l.resp.StatusCode; status/100 != 2 {
		return upstreamError("prefill", status, readError(l.resp)), nil
	}
	l.resp.releaseHead() // its status was all of it prefill needed
	var out []byte
	if r.mergeLogprobs() {
		out, err = io.ReadAll(l.resp)
		a.scanWhole(out)
	} else {
		err = a.drainPrefill(l.resp)
	}
	if err != nil && a.scope.Err() == nil {
		l.bodyFailed()
		return &apiError{Status: 502, Code: "prefill_server_error", Message: "Prefill server error: " + err.Error()}, nil
	}
	return nil, out
}

// sendFailed is the failure of prefill's send; nil when the attempt ended
// first for another reason, which is then why.
func (a *attempt) sendFailed(err error) *apiError {
	if a.scope.Err() != nil {
		return nil
	}
	return &apiError{Status: 502, Code: "prefill_server_error",
		Message: "Prefill server error: " + err.Error() + ". This will cause decode timeout."}
}

// failure returns prefill's error if prefill is what ended the attempt.
func (a *attempt) failure() *apiError {
	if a == nil || a.scope.Cause() != errPrefillFailed {
		return nil
	}
	<-a.done
	return a.err
}

// prefillQuickAnswer is how long sendBoth waits for prefill's first byte
// before it watches prefill from a goroutine and reads decode's reply. It
// is short because decode's reply waits meanwhile: a decode failing at once
// (its KV lost) would otherwise answer late on every retry.
const prefillQuickAnswer = 5 * time.Millisecond

// prefillHeadGrace is how long a stream whose decode answered first waits
// for prefill's reply head. SGLang's prefill answers its head at once and
// decode's first token needs prefill's KV, so this wait costs nothing
// there; an engine or mock whose prefill head comes late costs a stream at
// most this, and a prefill failing after it is an SSE error event.
const prefillHeadGrace = 200 * time.Millisecond

// prefillVerdict returns prefill's failure if its reply head (or its send)
// failed within prefillHeadGrace: a stream whose decode answered first is
// then still retried, nothing having reached the client.
func (a *attempt) prefillVerdict() *apiError {
	if a == nil || a.headed == nil {
		return nil
	}
	select {
	case <-a.headed:
	default:
		if !waitClosed(a.headed, prefillHeadGrace) {
			return nil
		}
	}
	if a.headOK {
		return nil
	}
	<-a.done
	return a.err
}

// graceTimers serve waitClosed: nearly every stream waits for prefill's
// head, and a fresh timer costs three allocations. Since Go 1.23 a stopped
// timer's channel holds no stale tick, so a pooled one may be reset.
var graceTimers = sync.Pool{New: func() any {
	t := time.NewTimer(time.Hour)
	t.Stop()
	return t
}}

// waitClosed reports whether ch closes within d.
func waitClosed(ch <-chan struct{}, d time.Duration) bool {
	t := graceTimers.Get().(*time.Timer)
	t.Reset(d)
	closed := false
	select {
	case <-ch:
		closed = true
	case <-t.C:
	}
	t.Stop()
	graceTimers.Put(t)
	return closed
}

// releaseBody returns once no leg of the attempt reads the client's body
// any more (writeGuard.release): a prefill still writing it when the reply
// is over gets bodyWriteGrace to finish, one not yet writing gets a copy.
func (a *attempt) releaseBody() {
	if a != nil {
		a.guard.release(&a.body, a.abandon)
	}
}

// abandon ends the attempt for a reason other than prefill: prefill's leg
// is cancelled if still running.
func (a *attempt) abandon() {
	if a != nil {
		a.scope.cancel(errAttemptOver)
	}
}

// logprobs is prefill's reply when decode's must be merged with it, once
// prefill has answered; false when there is nothing to merge.
func (a *attempt) logprobs(r *request) ([]byte, bool) {
	if a == nil || !r.mergeLogprobs() {
		return nil, false
	}
	select {
	case <-a.done:
		return a.logp, a.err == nil
	case <-a.scope.Done():
		return nil, false
	}
}

// mergeLogprobs reports whether prefill's input_token_logprobs must be
// prepended to decode's: SGLang /generate with return_logprob (the OpenAI
// routes carry no meta_info, so there is nothing to merge).
func (r *request) mergeLogprobs() bool {
	return r.route == routeGenerate && r.info.ReturnLogprob
}

// openDecode opens the request's leg on dw and sends it. False means no
// reply follows: the failure to report is returned (nil when the client is
// gone).
func (s *Server) openDecode(r *request, a *attempt, dw *balancer.Worker) (*apiError, bool) {
	l := &r.leg
	l.open(r, dw, a.rid)
	return s.decodeReply(r, a, l.send(&a.scope, r.path, a.decodeBody(), r.header))
}

// decodeBody is what the decode leg sends.
func (a *attempt) decodeBody() *splice.Body {
	if a.decode != nil {
		return a.decode
	}
	return &a.body
}

func decodeSendError(err error) *apiError {
	return &apiError{Status: 502, Code: "decode_server_error", Message: "Decode server error: " + err.Error()}
}

// decodeReply judges decode's reply head, or err, its send's failure, as
// openDecode returns it.
func (s *Server) decodeReply(r *request, a *attempt, err error) (*apiError, bool) {
	l := &r.leg
	if err != nil {
		l.close()
		if f := a.failure(); f != nil {
			return f, false // JSON even for a stream: nothing was sent yet (as OpenAI and SGLang)
		}
		a.abandon()
		if r.clientGone() {
			return nil, false
		}
		return decodeSendError(err), false
	}
	if status := l.resp.StatusCode; status/100 != 2 {
		eb := readError(l.resp)
		l.close()
		a.abandon()
		e := upstreamError("decode", status, eb)
		if r.info.Stream {
			e.Status, e.sse = status, true
		}
		return e, false
	}
	return nil, true
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
