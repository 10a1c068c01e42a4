package router

import (
	"io"
	"sync/atomic"
	"time"

	"github.com/pdrouter/pdrouter/balancer"
	"github.com/pdrouter/pdrouter/router/splice"
)

// record is what one request did, filled along the path as plain data and
// emitted once, when the request ends, as Pingora's logging phase does: the
// admission decision, the route's series and outcome, the times to first
// byte (the route's and PD's), the workers chosen, the retries and their
// backoffs, the legs that failed on their worker, each PD attempt's prefill
// duration and KV transfer time, and the request's span. A request ends
// when its response is complete and every leg it started is done (release):
// a prefill may outlive the response, and what it did is the request's too.
type record struct {
	admission admission
	badPDBody bool // a PD body that could not take the bootstrap fields
	routed    bool // routing started: the route's series count it
	exhausted bool // the last of several attempts failed
	outcome   outcome
	errorType string // smg_router_request_errors_total's, when failed

	model     string        // the route's model label
	pdStart   time.Time     // when the last PD attempt sent its prefill leg
	firstByte time.Duration // from the start to the first byte to the client; zero: none
	took      time.Duration // from the start to the complete response (responded)

	// Written by the handler, one attempt after another.
	picked      []*balancer.Worker // each policy's choice, in order
	pickedSpace [2]*balancer.Worker
	backoffs    []time.Duration // each retry's backoff, in order

	// pd is each PD attempt's readings (startPD). The handler starts an
	// attempt once the last one's legs are done (settle); its prefill
	// goroutine and its handler then write their own fields of the last.
	pd      []pdReading
	pdSpace [1]pdReading

	// The legs that failed on their worker are r.failed's (leg.go): they
	// close on two goroutines, and its lock is theirs.
}

// pdReading is what a PD attempt measured, in seconds; negative: nothing.
type pdReading struct {
	prefill    float64 // its prefill leg's duration (a reply, in time)
	kvTransfer float64 // the KV transfer time one of its replies reported (kvReport)
}

type admission uint8

const (
	notAdmitted admission = iota // refused before admission (bad method, body)
	admitted
	rejected // queue full or timed out
)

type outcome uint8

const (
	outcomeNone      outcome = iota // refused before routing, or streamed (the duration family counts whole replies)
	outcomeSucceeded                // a whole reply, written
	outcomeFailed                   // errorType says why
)

// fail records why a routed request failed.
func (rec *record) fail(errorType string) { rec.outcome, rec.errorType = outcomeFailed, errorType }

// responded records the end of the client's response (finish), and for
// the span the status the client got and why the request was cut short.
func (rec *record) responded(r *request) {
	if rec.firstByte != 0 && !r.info.Stream {
		// A whole reply was complete when its first byte was stamped, the
		// last thing replyWhole does: one clock read serves both.
		rec.took = rec.firstByte
	} else {
		rec.took = time.Since(r.start)
	}
	if rt := r.trace; rt != nil {
		if rt.rctx != nil { // nil once a stream let fasthttp have it back (request.detach)
			rt.status = rt.rctx.Response.StatusCode()
		}
		rt.cause = r.scope.Cause()
	}
}

// pick records a policy's choice.
func (rec *record) pick(w *balancer.Worker) {
	if rec.picked == nil {
		rec.picked = rec.pickedSpace[:0]
	}
	rec.picked = append(rec.picked, w)
}

// startPD records a PD attempt sending its prefill leg now.
func (rec *record) startPD() {
	rec.pdStart = time.Now()
	if rec.pd == nil {
		rec.pd = rec.pdSpace[:0]
	}
	rec.pd = append(rec.pd, pdReading{prefill: -1, kvTransfer: -1})
}

// prefilled records the current PD attempt's prefill duration.
func (rec *record) prefilled(d time.Duration) { rec.pd[len(rec.pd)-1].prefill = d.Seconds() }

// emit observes everything r's record holds, once: when r's last reference
// goes (release).
func (r *request) emit() {
	s, rec := r.s, &r.rec
	switch rec.admission {
	case admitted:
		s.metrics.admitted.Inc()
	case rejected:
		s.metrics.rateLimit.WithLabelValues("rejected").Inc()
	}
	if rec.badPDBody {
		s.pdm.bootstrapFailures.Inc()
	}
	for _, w := range rec.picked {
		s.bm.Selected(w, s.policies[w.Type].Name())
	}
	for _, f := range r.failed.legs {
		s.bm.WorkerError(f.w, f.errorType)
	}
	if rec.routed {
		rm := s.metrics.forRoute(routeKey{s.backendType(), r.route, rec.model, r.info.Stream})
		rm.requests.Inc()
		var pd *pdSeries
		if len(rec.pd) > 0 {
			pd = s.pdm.forModel(rec.model)
			for _, x := range rec.pd {
				if x.prefill >= 0 {
					pd.prefill.Observe(x.prefill)
				}
				if x.kvTransfer >= 0 {
					pd.kvTransfer.Observe(x.kvTransfer)
				}
			}
		}
		if rec.firstByte != 0 {
			rm.ttft.Observe(rec.firstByte.Seconds())
			if pd != nil {
				pd.ttft.Observe(r.start.Add(rec.firstByte).Sub(rec.pdStart).Seconds())
			}
		}
		endpoint := r.route.String()
		for i, b := range rec.backoffs {
			for _, t := range s.sides() {
				s.bm.Retry(t, endpoint, i+1, b)
			}
		}
		if rec.exhausted {
			for _, t := range s.sides() {
				s.bm.RetriesExhausted(t, endpoint)
			}
		}
		switch rec.outcome {
		case outcomeSucceeded:
			rm.duration.Observe(rec.took.Seconds())
		case outcomeFailed:
			s.metrics.routerErrors.WithLabelValues("http", s.backendType(), "http", rec.model, endpoint, rec.errorType).Inc()
		}
	}
	r.trace.end(r)
}

// kvReport is a PD attempt's KV transfer time: the first of its two replies
// to report one gives it (both may, for the same transfer: pdrouter's KV
// sidecar engines report it on decode, SGLang's own computes it on prefill,
// req_time_stats.py), and decode's reply is scanned as it streams.
type kvReport struct {
	seen   atomic.Bool
	decode splice.KVScan
}

// reported records ms unless the attempt's other reply did.
func (a *attempt) reported(ms float64) {
	if a.kv.seen.CompareAndSwap(false, true) {
		a.r.rec.pd[len(a.r.rec.pd)-1].kvTransfer = ms / 1000
	}
}

// scanDecode looks for the transfer time in the next piece of decode's
// reply; nil is regular mode.
func (a *attempt) scanDecode(p []byte) {
	if a == nil || a.kv.seen.Load() {
		return
	}
	if ms, ok := a.kv.decode.Feed(p); ok {
		a.reported(ms)
	}
}

// scanWhole looks for the transfer time in a whole reply; nil is regular
// mode.
func (a *attempt) scanWhole(body []byte) {
	if a == nil || a.kv.seen.Load() {
		return
	}
	if ms, ok := splice.KVTransferMS(body); ok {
		a.reported(ms)
	}
}

// drainPrefill reads prefill's reply to its end, looking for the transfer
// time in it.
func (a *attempt) drainPrefill(body io.Reader) error {
	if r, ok := body.(*upstreamResponse); ok && r.h2 != nil {
		var scan splice.KVScan
		return r.drainH2C(func(p []byte) {
			if !a.kv.seen.Load() {
				if ms, ok := scan.Feed(p); ok {
					a.reported(ms)
				}
			}
		})
	}
	bufp := chunkPool.Get().(*[]byte)
	defer chunkPool.Put(bufp)
	var scan splice.KVScan
	for {
		n, err := body.Read(*bufp)
		if n > 0 && !a.kv.seen.Load() {
			if ms, ok := scan.Feed((*bufp)[:n]); ok {
				a.reported(ms)
			}
		}
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return err
		}
	}
}
