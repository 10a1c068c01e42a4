package router

import (
	"context"
	"errors"

	"github.com/pdrouter/pdrouter/balancer"
)

// leg is one upstream request bound to one worker: a prefill, decode or
// regular request. open takes the worker's load slot; close gives it back
// exactly once, whichever way the request ended, and only then feeds the
// outcome to the worker's breaker and the worker-error metric and releases
// the reply. The rest of the router never touches those three.
//
// A leg is a value inside the request or the PD attempt, so opening one
// allocates nothing.
type leg struct {
	s      *Server
	w      *balancer.Worker
	resp   *upstreamResponse // the reply, once its head has arrived
	blame  bool              // no reply, and the worker is why (not a cancellation)
	broke  bool              // the reply's body broke off, and the worker is why
	closed bool
	sc     *scope    // what the leg was sent under; its end may leave the engine busy
	rid    engineRID // what the engine knows the request by (abort.go)
}

// open binds the leg to w and takes w's load slot.
func (l *leg) open(s *Server, w *balancer.Worker) {
	*l = leg{s: s, w: w}
	w.IncLoad()
}

// send posts body to the leg's worker under sc and waits for the reply's
// head (then in l.resp). A failure is the worker's unless sc ended first
// for another reason than the request timeout: a client gone, a failed
// prefill or an abandoned attempt says nothing about this worker.
func (l *leg) send(sc *scope, path string, body, header []byte) error {
	l.sc = sc
	resp, err := l.s.upstream.post(sc, l.w.URL, path, body, header)
	if err != nil {
		cause := sc.Cause()
		l.blame = cause == nil || errors.Is(cause, context.DeadlineExceeded)
		return err
	}
	l.resp = resp
	return nil
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
	l.abortIfHeld()
	switch {
	case l.resp != nil:
		status := l.resp.StatusCode
		l.w.Record(!l.broke && (status/100 == 2 || (status/100 == 4 && l.w.Type != balancer.Regular)))
		switch {
		case l.broke:
			l.s.bm.WorkerError(l.w, "body")
		case status/100 != 2:
			l.s.bm.WorkerError(l.w, "status_"+statusLabel(status))
		}
		l.resp.Close()
	case l.blame:
		l.w.Record(false)
		l.s.bm.WorkerError(l.w, "connect")
	}
	l.w.DecLoad()
}
