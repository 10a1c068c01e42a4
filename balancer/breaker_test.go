package balancer

import (
	"sync"
	"testing"
	"testing/synctest"
	"time"
)

// newTestBreaker is a breaker recording its transitions; tests of its
// timing run in a synctest bubble.
func newTestBreaker(fail, ok int, open time.Duration) (*Breaker, *[]string) {
	b := NewBreaker(BreakerConfig{FailureThreshold: fail, SuccessThreshold: ok, OpenDuration: open})
	var trans []string
	b.onTransition = func(from, to BreakerState) { trans = append(trans, from.String()+">"+to.String()) }
	return b, &trans
}

func TestBreakerLifecycle(t *testing.T) { synctest.Test(t, testBreakerLifecycle) }

func testBreakerLifecycle(t *testing.T) {
	b, trans := newTestBreaker(3, 2, time.Minute)
	b.Record(false)
	b.Record(false)
	b.Record(true) // a success resets the consecutive count
	b.Record(false)
	b.Record(false)
	if b.State() != BreakerClosed || !b.Allow() {
		t.Fatalf("opened before 3 consecutive failures: %v", b.State())
	}
	if f, _ := b.Counts(); f != 2 {
		t.Fatalf("consecutive failures = %d, want 2", f)
	}
	b.Record(false)
	if b.State() != BreakerOpen || b.Allow() {
		t.Fatal("3 consecutive failures did not open")
	}
	time.Sleep(59 * time.Second)
	if b.Allow() {
		t.Fatal("allowed before the open duration")
	}
	time.Sleep(time.Second)
	if !b.Allow() || b.State() != BreakerHalfOpen {
		t.Fatalf("not half-open after the open duration: %v", b.State())
	}
	b.Record(false) // any half-open failure reopens
	if b.State() != BreakerOpen || b.Allow() {
		t.Fatal("half-open failure did not reopen")
	}
	time.Sleep(time.Minute)
	b.Allow()
	b.Record(true)
	if b.State() != BreakerHalfOpen {
		t.Fatal("closed after 1 of 2 successes")
	}
	b.Record(true)
	if b.State() != BreakerClosed {
		t.Fatal("2 half-open successes did not close")
	}
	want := []string{"closed>open", "open>half_open", "half_open>open", "open>half_open", "half_open>closed"}
	if len(*trans) != len(want) {
		t.Fatalf("transitions %v, want %v", *trans, want)
	}
	for i := range want {
		if (*trans)[i] != want[i] {
			t.Fatalf("transitions %v, want %v", *trans, want)
		}
	}
}

func TestBreakerDisabledCountsSuccesses(t *testing.T) {
	b := NewBreaker(BreakerConfig{Disabled: true, FailureThreshold: 1})
	for range 5 {
		b.Record(false)
	}
	b.Record(true)
	if !b.Allow() || b.State() != BreakerClosed {
		t.Fatal("disabled breaker blocked traffic")
	}
	if b.successes() != 1 {
		t.Fatalf("success total %d, want 1 (passive health needs it)", b.successes())
	}
}

// Concurrent failures open the breaker exactly once.
func TestBreakerConcurrentOpenOnce(t *testing.T) {
	b, _ := newTestBreaker(50, 1, time.Minute)
	var mu sync.Mutex
	opens := 0
	b.onTransition = func(_, to BreakerState) {
		if to == BreakerOpen {
			mu.Lock()
			opens++
			mu.Unlock()
		}
	}
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for range 100 {
				b.Record(false)
				b.Allow()
			}
		})
	}
	wg.Wait()
	if opens != 1 || b.State() != BreakerOpen {
		t.Fatalf("opens = %d, state %v", opens, b.State())
	}
}
