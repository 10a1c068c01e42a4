package balancer

import (
	"context"
	"net"
	"net/http"
	"sync"
	"testing"
	"testing/synctest"
	"time"
)

// Each ejection in a row lasts one base time longer, up to the cap; time
// spent closed walks the multiplier back.
func TestBreakerEjectionBackoff(t *testing.T) { synctest.Test(t, testBreakerEjectionBackoff) }

func testBreakerEjectionBackoff(t *testing.T) {
	b, _ := newTestBreaker(1, 1, 10*time.Second)
	b.cfg.MaxOpenDuration = 35 * time.Second
	openFor := func() time.Duration {
		t.Helper()
		b.Record(false)
		if b.State() != BreakerOpen {
			t.Fatalf("failure did not eject: %v", b.State())
		}
		start := time.Now()
		for b.Allow() == false {
			time.Sleep(time.Second)
		}
		return time.Now().Sub(start)
	}
	for i, want := range []time.Duration{10, 20, 30, 35} { // half-open failures: ejections in a row
		if got := openFor(); got != want*time.Second {
			t.Fatalf("ejection %d lasted %v, want %v s", i+1, got, want)
		}
	}
	b.Record(true) // closes (success threshold 1)
	time.Sleep(25 * time.Second)
	// 4 in a row, then 2.5 base times closed: 2 steps back, so the next is the 3rd.
	if got := openFor(); got != 30*time.Second {
		t.Fatalf("after 25 s closed: ejection lasted %v, want 30 s", got)
	}
	b.Record(true)
	time.Sleep(time.Hour)
	if got := openFor(); got != 10*time.Second {
		t.Fatalf("after an hour closed: ejection lasted %v, want the base 10 s", got)
	}
}

// A half-open breaker admits one trial at a time: none while a request
// waits for a reply head.
func TestBreakerHalfOpenLimitsTrials(t *testing.T) { synctest.Test(t, testBreakerHalfOpenLimitsTrials) }

func testBreakerHalfOpenLimitsTrials(t *testing.T) {
	w := NewWorker("http://10.0.0.1:1", Decode, NoBootstrapPort)
	w.Breaker = NewBreaker(BreakerConfig{FailureThreshold: 1, SuccessThreshold: 2, OpenDuration: time.Second})
	w.AwaitReply() // stuck since before the ejection
	w.Record(false)
	time.Sleep(time.Second)
	if w.Available() {
		t.Fatal("half-open admitted a trial while a request waits for a reply")
	}
	if w.Breaker.State() != BreakerHalfOpen {
		t.Fatalf("not half-open after the ejection: %v", w.Breaker.State())
	}
	w.ReplyDone(true)
	if !w.Available() {
		t.Fatal("half-open refused a trial with nothing waiting")
	}
	w.AwaitReply() // the trial
	if w.Available() {
		t.Fatal("half-open admitted a second trial while the first waits")
	}
	w.ReplyDone(true)
	w.Record(true)
	w.Record(true)
	if w.Breaker.State() != BreakerClosed || !w.Available() {
		t.Fatalf("2 successful trials did not close: %v", w.Breaker.State())
	}
}

func poolOf(t *testing.T, n int, cfg BreakerConfig) []*Worker {
	t.Helper()
	reg := NewRegistry()
	newOutlierDetector(ManagerConfig{}, reg, nil) // only joins the pools: no stall timeout
	ws := make([]*Worker, n)
	for i := range ws {
		ws[i] = NewWorker("http://10.0.0."+string(rune('1'+i))+":1", Decode, NoBootstrapPort)
		ws[i].Breaker = NewBreaker(cfg)
		reg.Add(ws[i])
	}
	return ws
}

// Envoy's max_ejection_percent: ejections stop once the pool's unavailable
// share reaches the cap, so of two workers one is left; a lone worker is
// still ejected.
func TestMaxEjectionPercent(t *testing.T) {
	cfg := BreakerConfig{FailureThreshold: 2, SuccessThreshold: 1, OpenDuration: time.Minute, MaxEjectionPercent: 50}
	for _, tc := range []struct{ n, ejected int }{{1, 1}, {2, 1}, {3, 2}, {4, 2}} {
		ws := poolOf(t, tc.n, cfg)
		var refused int
		for _, w := range ws {
			w.Breaker.onEject = func(reason string, enforced bool) {
				if !enforced && reason == ejectFailures {
					refused++
				}
			}
			for range 3 {
				w.Record(false)
			}
		}
		ejected := 0
		for _, w := range ws {
			if !w.Available() {
				ejected++
			}
		}
		if ejected != tc.ejected || refused == 0 && tc.n > tc.ejected {
			t.Errorf("%d failing workers: %d ejected (want %d), %d refusals", tc.n, ejected, tc.ejected, refused)
		}
		// A refused worker stays one failure short: once another returns,
		// its next failure ejects it.
		if tc.n == 2 {
			left := ws[1]
			if f, _ := left.Breaker.Counts(); !left.Available() || f != 1 {
				t.Fatalf("refused worker: available %v, %d failures, want 1", left.Available(), f)
			}
			ws[0].SetHealthy(true)
			ws[0].Breaker.openFor.Store(0) // its ejection is over
			left.Record(false)
			if left.Available() {
				t.Fatal("the refused worker was not ejected once the other one was back")
			}
		}
	}
	// An unhealthy worker counts against the cap too.
	ws := poolOf(t, 2, cfg)
	ws[0].SetHealthy(false)
	for range 3 {
		ws[1].Record(false)
	}
	if !ws[1].Available() {
		t.Fatal("ejected the last healthy worker of two")
	}
}

// hungServer accepts connections and never reads or answers, as a
// SIGSTOPped process whose kernel still completes handshakes.
func hungServer(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var conns []net.Conn
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		<-done
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
	})
	return "http://" + ln.Addr().String()
}

// A probe of a worker that never answers ends at the health check timeout,
// and such probes mark it unhealthy after the failure threshold.
func TestHealthProbeOfHungWorkerTimesOut(t *testing.T) {
	url := hungServer(t)
	reg := NewRegistry()
	w := NewWorker(url, Regular, NoBootstrapPort)
	reg.Add(w)
	h := &healthChecker{cfg: HealthConfig{Endpoint: "/health", Interval: time.Hour, Timeout: 100 * time.Millisecond,
		FailureThreshold: 2, SuccessThreshold: 1}, reg: reg, client: &http.Client{}}
	for range 2 {
		start := time.Now()
		h.round(context.Background())
		if d := time.Since(start); d > time.Second {
			t.Fatalf("a round over a hung worker took %v, want the 100 ms timeout", d)
		}
	}
	if w.Healthy() {
		t.Fatal("hung worker still healthy after 2 timed-out probes")
	}
	h.client.CloseIdleConnections()
}

// A half-open failure the cap keeps closed closes the breaker now: the
// back-off decays from then, not from an earlier close (which would count
// the ejection itself as time spent closed and reset the multiplier).
func TestBreakerCapCloseRestartsBackoffDecay(t *testing.T) {
	synctest.Test(t, testBreakerCapCloseRestartsBackoffDecay)
}

func testBreakerCapCloseRestartsBackoffDecay(t *testing.T) {
	ws := poolOf(t, 2, BreakerConfig{FailureThreshold: 1, SuccessThreshold: 1, OpenDuration: 10 * time.Second,
		MaxOpenDuration: 100 * time.Second, MaxEjectionPercent: 50})
	b := ws[0].Breaker
	reopen := func(wait time.Duration) {
		t.Helper()
		time.Sleep(wait)
		if !b.Allow() || b.State() != BreakerHalfOpen {
			t.Fatalf("not half-open after %v: %v", wait, b.State())
		}
	}
	b.Record(false) // 1st ejection: 10 s
	reopen(10 * time.Second)
	b.Record(true) // closed
	b.Record(false)
	if got := time.Duration(b.openFor.Load()); got != 20*time.Second {
		t.Fatalf("2nd ejection in a row lasts %v, want 20 s", got)
	}
	reopen(20 * time.Second)
	ws[1].SetHealthy(false)
	b.Record(false) // the cap keeps it closed
	if b.State() != BreakerClosed {
		t.Fatalf("ejected past the cap: %v", b.State())
	}
	ws[1].SetHealthy(true)
	b.Record(false) // at once: no time spent closed, so the 3rd in a row
	if got := time.Duration(b.openFor.Load()); b.State() != BreakerOpen || got != 30*time.Second {
		t.Fatalf("ejection right after a cap-close: %v for %v, want open for 30 s", b.State(), got)
	}
}
