package balancer

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"
	"testing/synctest"
	"time"
)

func newTestChecker(t *testing.T, e *fakeEngine) (*healthChecker, *Worker) {
	reg := NewRegistry()
	w := NewWorker(e.URL, Regular, NoBootstrapPort)
	reg.Add(w)
	cfg := HealthConfig{Endpoint: "/health", Interval: time.Hour, Timeout: time.Second, FailureThreshold: 3, SuccessThreshold: 2}
	return &healthChecker{cfg: cfg, reg: reg, client: http.DefaultClient}, w
}

func TestHealthThresholds(t *testing.T) {
	e := newFakeEngine(t, 200)
	h, w := newTestChecker(t, e)
	ctx := context.Background()
	e.healthStatus.Store(503)
	h.round(ctx)
	h.round(ctx)
	if !w.Healthy() {
		t.Fatal("unhealthy after 2 failures with threshold 3")
	}
	h.round(ctx)
	if w.Healthy() || w.Available() {
		t.Fatal("still healthy after 3 failures")
	}
	e.healthStatus.Store(200)
	h.round(ctx)
	if w.Healthy() {
		t.Fatal("healthy after 1 success with threshold 2")
	}
	h.round(ctx)
	if !w.Healthy() {
		t.Fatal("not healthy after 2 successes")
	}
	if e.probes.Load() != 5 {
		t.Fatalf("probes = %d, want 5", e.probes.Load())
	}
}

// A worker that completes requests is not evicted by failing probes.
func TestHealthPassiveSuccess(t *testing.T) {
	e := newFakeEngine(t, 503)
	h, w := newTestChecker(t, e)
	ctx := context.Background()
	for range 5 {
		w.Record(true) // the router saw a completed request since the last probe
		h.round(ctx)
	}
	if !w.Healthy() {
		t.Fatal("busy worker evicted despite completing requests")
	}
	for range 3 {
		h.round(ctx) // no requests completed any more
	}
	if w.Healthy() {
		t.Fatal("idle failing worker stayed healthy")
	}
}

func TestHealthSkipsDisabledAndTimesOut(t *testing.T) {
	e := newFakeEngine(t, 503)
	h, w := newTestChecker(t, e)
	w.DisableHealthCheck = true
	for range 4 {
		h.round(context.Background())
	}
	if !w.Healthy() || e.probes.Load() != 0 {
		t.Fatalf("worker with disable_health_check probed %d times", e.probes.Load())
	}
	// A probe slower than the timeout fails.
	slow := httptest.NewServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) { time.Sleep(300 * time.Millisecond) }))
	defer slow.Close()
	if probe(context.Background(), http.DefaultClient, NewWorker(slow.URL, Regular, 0), "/health", 50*time.Millisecond) {
		t.Fatal("probe past its timeout succeeded")
	}
}

// The manager's loop evicts a dead worker and readmits it when it
// recovers, at its interval and thresholds (on synctest's clock).
func TestHealthLoopEvictsAndRecovers(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		cfg := ManagerConfig{Health: HealthConfig{Interval: 10 * time.Second, Timeout: time.Second, FailureThreshold: 2, SuccessThreshold: 2}}
		m, ws, fn, _ := stallPool(t, cfg, 200)
		defer m.Stop()
		w := ws[0]
		synctest.Wait() // the first round, at once: passes
		fn.set(w.URL, 500)
		after(15 * time.Second) // probes at 10 s (1st failure)
		if !w.Healthy() {
			t.Fatal("evicted after one failure with threshold 2")
		}
		after(10 * time.Second) // 20 s: the 2nd
		if w.Healthy() || len(m.Snapshot().Available(Decode)) != 0 {
			t.Fatal("still healthy or available after 2 failed probes")
		}
		fn.set(w.URL, hang)
		after(20 * time.Second) // probes time out: still failures
		if w.Healthy() {
			t.Fatal("readmitted while its probes time out")
		}
		fn.set(w.URL, 200)
		after(20 * time.Second)
		if !w.Healthy() || len(m.Snapshot().Available(Decode)) != 1 {
			t.Fatal("not readmitted after 2 passing probes")
		}
	})
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}
