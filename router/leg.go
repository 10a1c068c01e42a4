package router

import (
	"context"
	"errors"
	"slices"
	"sync"
	"syscall"
	"time"

	"github.com/pdrouter/pdrouter/balancer"
	"github.com/pdrouter/pdrouter/router/splice"
)

// leg is one upstream request bound to one worker: a prefill, decode or
// regular request. open takes the worker's load slot; close gives it back
// exactly once, whichever way the request ended, and only then feeds the
// outcome to the worker's breaker and the request's record and releases
// the reply. The rest of the router never touches those three.
//
// A leg is a value inside the request or the PD attempt, so opening one
// allocates nothing.
type leg struct {
	s      *Server
	w      *balancer.Worker
	resp   *upstreamResponse // the reply, once its head has arrived
	failed *failedWorkers    // the client request's: its failure reaches each worker's breaker once
	sc     *scope            // what the leg was sent under; its end may leave the engine busy
	rid    engineRID         // what the engine knows the request by (abort.go)
	trace  *legSpan          // nil unless traced (trace.go)
	guard  *writeGuard       // set where the leg may outlive the body's owner (prefill)

	call  *upCall          // an HTTP/1.1 leg's request, from its write to its reply's head (upCalls)
	reply upstreamResponse // its reply (resp): no allocation of its own
	req   *request         // the leg's: a retry waits for its engine aborts (request.aborts), which pin it

	// The flags together: a leg lives in every open request and attempt.
	blame   bool // no reply, and the worker is why (not a cancellation)
	broke   bool // the reply's body broke off, and the worker is why
	closed  bool
	lost    bool // the send failed after the dial: the engine may hold the request
	written bool // write sent it; its reply head is still to be read
}

// open binds a leg of r, whose engine knows it by rid, to w and takes w's
// load slot: the one leg set-up of both modes.
func (l *leg) open(r *request, w *balancer.Worker, rid engineRID) {
	*l = leg{s: r.s, w: w, failed: &r.failed, req: r, rid: rid, trace: r.trace.leg()}
	w.IncLoad()
}

// failedWorkers are the workers a client request's legs failed on. However
// many attempts a request makes, each worker's breaker hears of its
// failure once, and retries prefer the workers not in the set. Every
// failed leg is kept too, for the request's record to emit
// (smg_worker_errors_total). Legs of one attempt close on different
// goroutines, hence the lock.
type failedWorkers struct {
	mu   sync.Mutex
	ws   []*balancer.Worker
	legs []legFailure
}

// legFailure is one leg's failure that its worker is blamed for.
type legFailure struct {
	w         *balancer.Worker
	errorType string
}

// blame records a leg that failed on w.
func (f *failedWorkers) blame(w *balancer.Worker, errorType string) {
	f.mu.Lock()
	f.legs = append(f.legs, legFailure{w, errorType})
	f.mu.Unlock()
}

// add reports whether w is new to the set.
func (f *failedWorkers) add(w *balancer.Worker) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	if slices.Contains(f.ws, w) {
		return false
	}
	f.ws = append(f.ws, w)
	return true
}

// without is avail less the failed workers, or avail itself when nothing
// would be left (a lone worker is still retried).
func (f *failedWorkers) without(avail []*balancer.Worker) []*balancer.Worker {
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.ws) == 0 {
		return avail
	}
	fresh := make([]*balancer.Worker, 0, len(avail))
	for _, w := range avail {
		if !slices.Contains(f.ws, w) {
			fresh = append(fresh, w)
		}
	}
	if len(fresh) == 0 {
		return avail
	}
	return fresh
}

// record tells the breaker the leg's outcome; a failure only the first
// time this worker fails the client request.
func (l *leg) record(ok bool) {
	if ok || l.failed == nil || l.failed.add(l.w) {
		l.w.Record(ok)
	}
}

// send posts body to the leg's worker under sc and waits for the reply's
// head (then in l.resp). A failure is the worker's unless sc ended first
// for another reason than the request timeout: a client gone, a failed
// prefill or an abandoned attempt says nothing about this worker. A leg
// that write sent already only waits.
func (l *leg) send(sc *scope, path string, body *splice.Body, header []byte) error {
	if l.written {
		return l.await()
	}
	if l.w.HTTP2 {
		l.begin(sc, path, &header)
		resp, err := l.s.upstream.postH2C(sc, l.w.BaseURL, path, body, header, l.guard, &l.reply)
		return l.answered(resp, err)
	}
	if _, err := l.writeWait(sc, path, body, header, nil, 0); err != nil {
		return err
	}
	return l.await()
}

// writeWait is write, after, then a wait of up to d (0: no limit) for the
// reply's first byte in one (upCall.writeWait): it returns write's failure,
// or whether the reply began within d. A PD attempt writes its decode leg
// in after, before it waits for prefill.
func (l *leg) writeWait(sc *scope, path string, body *splice.Body, header []byte, after afterWrite, d time.Duration) (bool, error) {
	l.begin(sc, path, &header)
	l.call = upCalls.Get().(*upCall)
	began, err := l.call.writeWait(l.s.upstream, sc, l.w.BaseURL, path, body, header, l.guard, after, d)
	if err != nil {
		l.releaseCall()
		return false, l.answered(nil, err)
	}
	l.written = true
	return began, nil
}

// write sends the request of an HTTP/1.1 leg without waiting for its
// reply (await): a PD attempt writes both legs before it waits for either.
func (l *leg) write(sc *scope, path string, body *splice.Body, header []byte) error {
	l.begin(sc, path, &header)
	l.call = upCalls.Get().(*upCall)
	if err := l.call.write(l.s.upstream, sc, l.w.BaseURL, path, body, header, l.guard); err != nil {
		l.releaseCall()
		return l.answered(nil, err)
	}
	l.written = true
	return nil
}

// await waits for the reply's head of the request write sent.
func (l *leg) await() error {
	l.written = false
	l.call.into = &l.reply
	resp, err := l.call.head()
	l.releaseCall()
	return l.answered(resp, err)
}

// upCalls pools the legs' HTTP/1.1 calls: a call is done once its reply's
// head is in, and an open stream (an h2c one never has one) kept its 168
// bytes inside its request and attempt to its end, ~2.5 MB at 10,000.
var upCalls = sync.Pool{New: func() any { return new(upCall) }}

func (l *leg) releaseCall() {
	*l.call = upCall{}
	upCalls.Put(l.call)
	l.call = nil
}

func (l *leg) begin(sc *scope, path string, header *[]byte) {
	l.sc = sc
	*header = l.trace.start(l, path, *header)
	l.w.AwaitReply()
}

// answered ends the wait begin started.
func (l *leg) answered(resp *upstreamResponse, err error) error {
	l.w.ReplyDone(err == nil) // a reply head, of any status: the worker answers
	if err != nil {
		cause := l.sc.Cause()
		l.blame = (cause == nil || errors.Is(cause, context.DeadlineExceeded)) && !outOfLocalResources(err)
		l.lost = !errors.As(err, new(dialError))
		return err
	}
	l.resp = resp
	return nil
}

// outOfLocalResources reports a failure of the router's own host: no
// descriptor, buffer or local port for the connection. Blaming the worker
// for it would open its breaker, and a router out of descriptors under a
// burst of streams would then refuse every request until the breaker
// closes, even once descriptors are free again.
func outOfLocalResources(err error) bool {
	for _, e := range []syscall.Errno{syscall.EMFILE, syscall.ENFILE, syscall.ENOBUFS, syscall.ENOMEM, syscall.EADDRNOTAVAIL} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}

// bodyFailed records that the reply's body broke off before its end (a
// 200 then a closed connection): a failure of the worker, unless the leg's
// scope had ended (client gone, timeout, other leg failed), which is then
// what cut the read.
func (l *leg) bodyFailed() {
	l.broke = l.sc.Cause() == nil
}

// close ends the leg; calls after the first do nothing. The breaker hears
// the reply's status (PD counts a 4xx as the worker answering; regular
// mode only a 2xx) or, without a reply, a failure the worker is blamed for.
func (l *leg) close() {
	if l.closed {
		return
	}
	l.closed = true
	if l.written { // sent, and its reply never awaited (the attempt ended first)
		l.written = false
		l.w.ReplyDone(false)
		l.call.abandon()
		l.releaseCall()
	}
	l.trace.end(l)
	l.abortIfHeld()
	switch {
	case l.resp != nil:
		status := l.resp.StatusCode
		l.record(!l.broke && (status/100 == 2 || (status/100 == 4 && l.w.Type != balancer.Regular)))
		switch {
		case l.broke:
			l.failed.blame(l.w, "body")
		case status/100 != 2:
			l.failed.blame(l.w, "status_"+statusLabel(status))
		}
		l.resp.Close()
	case l.blame:
		l.record(false)
		l.failed.blame(l.w, "connect")
	}
	l.w.DecLoad()
}
