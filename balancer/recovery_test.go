package balancer

import (
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"
)

// traffic sends w a request every 100 ms for d whenever it is available,
// each succeeding iff ok says so at that moment, and returns when the
// breaker last closed after having opened (0: never) and how many
// requests failed after the first ejection.
func traffic(w *Worker, d time.Duration, ok func(elapsed time.Duration) bool) (closedAt time.Duration, failedTrials int) {
	start := time.Now()
	opened := false
	for e := time.Duration(0); e < d; e = time.Since(start) {
		if w.Available() {
			w.AwaitReply()
			w.ReplyDone(true)
			good := ok(e)
			if opened && !good {
				failedTrials++
			}
			w.Record(good)
		}
		switch st := w.Breaker.State(); {
		case st == BreakerOpen:
			opened = true
		case st == BreakerClosed && opened && closedAt == 0:
			closedAt = e
		}
		after(100 * time.Millisecond)
	}
	return closedAt, failedTrials
}

// A kvproxy restart of 10 s (the engine answers 503 meanwhile, its /health
// passes) used to cost the 60 s of a failure ejection. Half-open trials now
// come after 1, 2, 4, 8 s (the sweep period doubling per ejection in a
// row) while the worker's probe passes: service is back within about the
// outage's length again.
func TestFailureEjectionRecoversSoonAfterOutage(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m, ws, _, _ := stallPool(t, ManagerConfig{}, 200, 200)
		defer m.Stop()
		outage := 10 * time.Second
		closedAt, failed := traffic(ws[0], 90*time.Second, func(e time.Duration) bool { return e >= outage })
		t.Logf("closed %v after the outage began, %d failed trials", closedAt, failed)
		if closedAt == 0 || closedAt > 2*outage {
			t.Fatalf("breaker closed %v after a %v outage began, want within %v", closedAt, outage, 2*outage)
		}
		if failed > 5 {
			t.Fatalf("%d failed trials during the ejection, want at most 5", failed)
		}
	})
}

// When the worker's own health probe fails during a failure ejection, the
// ejection lasts until a probe passes, and ends at once then: no trial
// while the worker is down, however short its ejection time, and none
// held back once it is up.
func TestFailureEjectionFollowsWorkerHealth(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		cfg := ManagerConfig{Breaker: DefaultBreakerConfig()}
		cfg.Breaker.OpenDuration = 5 * time.Second
		cfg.Health.FailureThreshold = 1000 // the health checker keeps it healthy: the breaker alone decides
		m, ws, fn, _ := stallPool(t, cfg, 200, 200)
		defer m.Stop()
		w := ws[0]
		fn.set(w.URL, 503)
		for range cfg.Breaker.FailureThreshold {
			w.Record(false)
		}
		if w.Breaker.State() != BreakerOpen {
			t.Fatal("10 failures did not eject")
		}
		for range 30 {
			after(time.Second)
			if w.Available() {
				t.Fatal("a trial admitted while the worker's probe fails")
			}
		}
		fn.set(w.URL, 200)
		after(1500 * time.Millisecond)
		if !w.Available() || w.Breaker.State() != BreakerHalfOpen {
			t.Fatalf("1.5 s after its probe passes: available %v, state %v, want half_open", w.Available(), w.Breaker.State())
		}
	})
}

// Without health checks there is nothing to follow: a failure ejection
// lasts --cb-timeout-duration-secs, as in sglang-router.
func TestFailureEjectionWithoutProbesLastsItsTime(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		cfg := ManagerConfig{Health: HealthConfig{Disabled: true}}
		m, ws, _, _ := stallPool(t, cfg, 200)
		defer m.Stop()
		w := ws[0]
		for range 10 {
			w.Record(false)
		}
		after(59 * time.Second)
		if w.Available() {
			t.Fatal("half-open before the 60 s without probes")
		}
		after(time.Second)
		if !w.Available() {
			t.Fatal("not half-open after the 60 s")
		}
	})
}

// A half-open breaker offers its trial to one of many concurrent callers,
// and again only once the trial's hold has passed.
func TestHalfOpenAdmitsOneTrialUnderConcurrency(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		b := NewBreaker(BreakerConfig{FailureThreshold: 1, SuccessThreshold: 3, OpenDuration: time.Second})
		b.Record(false)
		time.Sleep(time.Second)
		var admitted atomic.Int32
		var wg sync.WaitGroup
		start := make(chan struct{})
		for range 16 {
			wg.Go(func() {
				<-start
				if b.Allow() {
					admitted.Add(1)
				}
			})
		}
		close(start)
		wg.Wait()
		if n := admitted.Load(); n != 1 || b.State() != BreakerHalfOpen {
			t.Fatalf("%d of 16 concurrent callers admitted (state %v), want 1", n, b.State())
		}
		time.Sleep(trialHold)
		if !b.Allow() {
			t.Fatal("no trial offered once the hold passed")
		}
	})
}

// Half-open trials in a row do not wait for the hold: one ends, the next
// is offered at once.
func TestHalfOpenTrialsInARow(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := NewWorker("http://10.0.0.1:1", Decode, NoBootstrapPort)
		w.Breaker = NewBreaker(BreakerConfig{FailureThreshold: 1, SuccessThreshold: 3, OpenDuration: time.Second})
		w.Record(false)
		time.Sleep(time.Second)
		for i := range 3 {
			if !w.Available() {
				t.Fatalf("trial %d not offered right after the previous one ended", i+1)
			}
			w.AwaitReply()
			w.ReplyDone(true)
			w.Record(true)
		}
		if w.Breaker.State() != BreakerClosed {
			t.Fatalf("3 trials in a row: %v, want closed", w.Breaker.State())
		}
	})
}
