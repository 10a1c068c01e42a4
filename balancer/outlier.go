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
// worker last answered one. It lives in the breaker, which every copy of a
// worker shares.
type outlierState struct {
	awaiting   atomic.Int32
	awaitSince atomic.Int64 // unix nanos when awaiting last rose from 0
	lastAnswer atomic.Int64 // unix nanos of the last reply head
	suspect    atomic.Bool  // stalled at the detector's last sweep, nothing answered since
	probing    atomic.Bool
	probedAt   atomic.Int64
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
	o.awaiting.Add(-1)
}

// Suspect reports whether the worker has had requests waiting for a reply
// head longer than the stall timeout, answering none meanwhile.
func (w *Worker) Suspect() bool { return w.Breaker != nil && w.Breaker.out.suspect.Load() }

// suspectLoad is added to a suspect worker's load where policies compare
// loads, so any worker still answering looks less loaded.
const suspectLoad = 1 << 40

// balanceLoad is the in-flight load policies balance on.
func (w *Worker) balanceLoad() int64 {
	if w.Suspect() {
		return w.Load() + suspectLoad
	}
	return w.Load()
}

func (o *outlierState) stalled(now int64, timeout time.Duration) bool {
	return o.awaiting.Load() > 0 && now-max(o.lastAnswer.Load(), o.awaitSince.Load()) >= int64(timeout)
}

// outlierDetector keeps breakers in their pools (for the ejection cap) and
// sweeps the workers for stalls: a worker that stops answering
// (SIGSTOPped, wedged) holds its requests until the request timeout, long
// before a consecutive-failure count sees anything. A stalled worker is
// suspect at once, and ejected (Breaker.Eject, within the pool's cap) when
// a health probe, bounded by the health check timeout, fails too: a worker
// whose answers are merely slow (long non-stream generations) passes it.
// Such an ejection ends on a passing probe only (a failing one ejects the
// worker again), so a worker still hung takes no trial request. Without
// probes (health checks disabled) a stall only steers.
type outlierDetector struct {
	reg    *Registry
	client *http.Client
	stall  time.Duration
	health HealthConfig
	probes sync.WaitGroup
}

// newOutlierDetector puts the registry's breakers in their pools from now
// on; it returns nil when stall detection is off.
func newOutlierDetector(cfg ManagerConfig, reg *Registry, client *http.Client) *outlierDetector {
	reg.OnChange(func(s *Snapshot) {
		for _, w := range s.All {
			w.Breaker.joinPool(reg, w.Type)
		}
	})
	if cfg.Breaker.StallTimeout <= 0 {
		return nil
	}
	return &outlierDetector{reg: reg, client: client, stall: cfg.Breaker.StallTimeout, health: cfg.Health}
}

// run sweeps every fifth of the stall timeout (50 ms to 1 s) until ctx
// ends, then waits for its probes.
func (d *outlierDetector) run(ctx context.Context) {
	tick := min(max(d.stall/5, 50*time.Millisecond), time.Second)
	runEvery(ctx, tick, func() { d.sweep(ctx, time.Now().UnixNano()) })
	d.probes.Wait()
}

// sweep marks stalled workers suspect and probes each at most once per
// stall timeout while its breaker lets traffic in, and a stall-ejected one
// when its time is up.
func (d *outlierDetector) sweep(ctx context.Context, now int64) {
	for _, w := range d.reg.Snapshot().All {
		b := w.Breaker
		if b == nil {
			continue
		}
		o := &b.out
		stalled := o.stalled(now, d.stall)
		if stalled != o.suspect.Load() {
			o.suspect.Store(stalled)
		}
		switch {
		case b.gateDue(now):
			d.probe(ctx, w, now, b.probed)
		case stalled && b.State() != BreakerOpen && now-o.probedAt.Load() >= int64(d.stall):
			d.probe(ctx, w, now, func(ok bool) {
				if !ok && o.stalled(time.Now().UnixNano(), d.stall) {
					b.Eject()
				}
			})
		}
	}
}

// probe checks w's health endpoint in the background, one probe per
// worker at a time, and hands the result to then.
func (d *outlierDetector) probe(ctx context.Context, w *Worker, now int64, then func(ok bool)) {
	o := &w.Breaker.out
	if d.health.Disabled || w.DisableHealthCheck || !o.probing.CompareAndSwap(false, true) {
		return
	}
	o.probedAt.Store(now)
	d.probes.Go(func() {
		defer o.probing.Store(false)
		ok := probe(ctx, d.client, w, d.health.Endpoint, d.health.Timeout)
		if ctx.Err() == nil {
			then(ok)
		}
	})
}
