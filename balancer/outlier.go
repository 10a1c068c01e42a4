package balancer

import (
	"context"
	"net/http"
	"sync"
	"sync/atomic"
	"time"
)

// outlierState is what the router tells of a worker's replies, for stall
// detection: requests sent whose reply head has not arrived, and when the
// worker last answered one; and what health probes tell. It lives in the
// breaker, which every copy of a worker shares.
type outlierState struct {
	awaiting   atomic.Int32
	awaitSince atomic.Int64 // unix nanos when awaiting last rose from 0
	lastAnswer atomic.Int64 // unix nanos of the last reply head
	suspect    atomic.Bool  // stalled at the detector's last sweep, nothing answered since
	probing    atomic.Bool
	probedAt   atomic.Int64 // unix nanos the last probe started
	// The last probe's verdict, the health checker's or the detector's: a
	// passing one restarts the stall clock (the worker is alive, its
	// replies merely slow), a failing one makes a short stall suspect.
	probeOKAt    atomic.Int64
	probeFailing atomic.Bool
	ejectAsked   atomic.Int64 // probedAt of the failed probe an ejection was last asked on
}

// probed records a probe's verdict at now.
func (o *outlierState) probed(ok bool, now int64) {
	if ok {
		o.probeOKAt.Store(now)
	}
	o.probeFailing.Store(!ok)
}

// AwaitReply counts a request sent to the worker whose reply head has not
// arrived; ReplyDone ends it.
func (w *Worker) AwaitReply() {
	if w.Breaker == nil {
		return
	}
	o := &w.Breaker.out
	if o.awaiting.Add(1) == 1 {
		// A sweep between the two writes may see the previous busy
		// period's start: at worst one early suspicion, which a probe checks.
		o.awaitSince.Store(time.Now().UnixNano())
	}
}

// ReplyDone ends an AwaitReply. answered: a reply head arrived, whatever
// its status (the worker is alive); false: it failed or was cut short.
func (w *Worker) ReplyDone(answered bool) {
	if w.Breaker == nil {
		return
	}
	o := &w.Breaker.out
	if answered {
		o.lastAnswer.Store(time.Now().UnixNano())
		if o.suspect.Load() {
			o.suspect.Store(false)
		}
	}
	held := w.Breaker.trialAt.Load()
	if o.awaiting.Add(-1) == 0 && held != 0 {
		w.Breaker.trialAt.CompareAndSwap(held, 0) // a half-open trial is over: the next may go at once
	}
}

// Suspect reports whether the detector's last sweep found the worker
// stalled (requests waiting for a reply head, none answered) with its
// probe failing, or past the stall timeout; an answer clears it.
func (w *Worker) Suspect() bool { return w.Breaker != nil && w.Breaker.out.suspect.Load() }

func (o *outlierState) stalled(now int64, timeout time.Duration) bool {
	return o.awaiting.Load() > 0 && now-max(o.lastAnswer.Load(), o.awaitSince.Load(), o.probeOKAt.Load()) >= int64(timeout)
}

// outlierDetector keeps breakers in their pools (for the ejection cap),
// sweeps the workers for stalls, and probes ejected workers to end their
// ejections (Breaker.recoveryDue, Breaker.probed).
//
// Stalls: a worker that stops answering (SIGSTOPped, wedged) holds its
// requests until the request timeout, long before a consecutive-failure
// count sees anything. A worker whose requests have waited a sweep period
// without a reply head (a short stall) is probed, at most once a period.
// It is suspect, and every policy steers around it (Snapshot.Available),
// when its health probe fails or hangs past a period during a short stall,
// or when the stall lasts the stall timeout with no probe passing
// meanwhile; a passing probe restarts the stall clock, so a worker busy
// with long non-streamed generations is not suspect. A stall of the full
// timeout whose last probe failed ejects the worker (Breaker.Eject, within
// the pool's cap; asked once per failed probe). Without probes (health
// checks disabled) a stall of the full timeout only steers.
type outlierDetector struct {
	reg    *Registry
	client *http.Client
	stall  time.Duration // 0: no stall detection
	period time.Duration // between sweeps; also the short stall
	health HealthConfig
	probes sync.WaitGroup
}

// newOutlierDetector puts the registry's breakers in their pools from now
// on; it returns nil when there is nothing to sweep for: no stall
// detection and no probes.
func newOutlierDetector(cfg ManagerConfig, reg *Registry, client *http.Client) *outlierDetector {
	reg.OnChange(func(s *Snapshot) {
		for _, w := range s.All {
			w.Breaker.joinPool(reg, w.Type)
		}
	})
	stall := max(cfg.Breaker.StallTimeout, 0)
	if stall == 0 && cfg.Health.Disabled {
		return nil
	}
	period := time.Second
	if stall > 0 {
		period = min(max(stall/5, 50*time.Millisecond), period, stall)
	}
	return &outlierDetector{reg: reg, client: client, stall: stall, health: cfg.Health, period: period}
}

// run sweeps every period (a fifth of the stall timeout, 50 ms to 1 s)
// until ctx ends, then waits for its probes.
func (d *outlierDetector) run(ctx context.Context) {
	runEvery(ctx, d.period, func() { d.sweep(ctx, time.Now().UnixNano()) })
	d.probes.Wait()
}

// sweep probes ejected workers whose recovery is due and checks each
// worker for a stall.
func (d *outlierDetector) sweep(ctx context.Context, now int64) {
	for _, w := range d.reg.Snapshot().All {
		b := w.Breaker
		if b == nil {
			continue
		}
		open := b.State() == BreakerOpen
		if opened, due := b.recoveryDue(now, d.period); open && due && now-b.out.probedAt.Load() >= int64(d.period) {
			d.probe(ctx, w, now, func(ok bool) { b.probed(opened, ok) })
		}
		if d.stall > 0 {
			d.checkStall(ctx, w, now, open)
		}
	}
}

// checkStall marks w suspect or not, probes a short stall, and ejects a
// long one whose probe failed.
func (d *outlierDetector) checkStall(ctx context.Context, w *Worker, now int64, open bool) {
	b := w.Breaker
	o := &b.out
	short, long := o.stalled(now, d.period), o.stalled(now, d.stall)
	hanging := o.probing.Load() && now-o.probedAt.Load() >= int64(d.period)
	suspect := long || short && (o.probeFailing.Load() || hanging)
	if suspect != o.suspect.Load() {
		o.suspect.Store(suspect)
	}
	switch {
	case open:
	case long && o.probeFailing.Load() && o.ejectAsked.Load() != o.probedAt.Load():
		o.ejectAsked.Store(o.probedAt.Load()) // once per failed probe: a refusal is counted once
		b.Eject()
	case short && now-o.probedAt.Load() >= int64(d.period):
		d.probe(ctx, w, now, nil)
	}
}

// probe checks w's health endpoint in the background, one probe per
// worker at a time, records the verdict and hands it to then (if any).
func (d *outlierDetector) probe(ctx context.Context, w *Worker, now int64, then func(ok bool)) {
	o := &w.Breaker.out
	if d.health.Disabled || w.DisableHealthCheck || !o.probing.CompareAndSwap(false, true) {
		return
	}
	o.probedAt.Store(now)
	d.probes.Go(func() {
		defer o.probing.Store(false)
		ok := probe(ctx, d.client, w, d.health.Endpoint, d.health.Timeout)
		if ctx.Err() != nil {
			return
		}
		o.probed(ok, time.Now().UnixNano())
		if then != nil {
			then(ok)
		}
	})
}
