package router

import (
	"io"
	"sync/atomic"
	"time"

	"github.com/pdrouter/pdrouter/router/splice"
)

// record is what one request did, filled along the path as plain data and
// emitted once, when the request ends (emit, from finish), as Pingora's
// logging phase does: the admission decision, the route's series and
// outcome, the times to first byte (the route's and PD's), retries run
// out, and the request's span. What belongs to a PD attempt rather than to
// the request (prefill's duration, the KV transfer time a reply reports,
// below) is observed by the attempt when it has it, since prefill may
// outlive the response; worker errors are the leg's (leg.go).
type record struct {
	admission admission
	badPDBody bool // a PD body that could not take the bootstrap fields

	route     *routeMetrics // the route's series, once routing started
	model     string        // its model label
	pd        *pdSeries     // PD stage series; nil in regular mode
	pdStart   time.Time     // when the last PD attempt sent its prefill leg
	firstByte time.Time     // when the first byte reached the client; zero: none
	exhausted bool          // the last of several attempts failed
	outcome   outcome
	errorType string // smg_router_request_errors_total's, when failed
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

// emit observes everything r's record holds, once.
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
	if rm := rec.route; rm != nil {
		rm.requests.Inc()
		if !rec.firstByte.IsZero() {
			rm.ttft.Observe(rec.firstByte.Sub(r.start).Seconds())
			if rec.pd != nil {
				rec.pd.ttft.Observe(rec.firstByte.Sub(rec.pdStart).Seconds())
			}
		}
		endpoint := r.route.String()
		if rec.exhausted {
			for _, t := range s.sides() {
				s.bm.RetriesExhausted(t, endpoint)
			}
		}
		switch rec.outcome {
		case outcomeSucceeded:
			rm.duration.Observe(since(r.start))
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

// reported observes ms unless the attempt's other reply did.
func (a *attempt) reported(ms float64) {
	if a.kv.seen.CompareAndSwap(false, true) {
		a.pd.kvTransfer.Observe(ms / 1000)
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
