package balancer

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"
)

// rate 1e-6/s: no refill within a test, so only releases free tokens.
func newTestAdmission(capacity, queue int, timeout time.Duration) *Admission {
	return NewAdmission(AdmissionConfig{MaxConcurrent: capacity, RatePerSecond: 1e-6, QueueSize: queue, QueueTimeout: timeout})
}

// As 0.3.2: --queue-size does not bound the waiters (its queue is drained
// at once), each times out on its own, and tokens come back once.
func TestAdmissionWaitersTimeOut(t *testing.T) {
	a := newTestAdmission(2, 1, 50*time.Millisecond)
	ctx := context.Background()
	r1, err1 := a.Acquire(ctx)
	_, err2 := a.Acquire(ctx)
	if err1 != nil || err2 != nil {
		t.Fatal(err1, err2)
	}
	start := time.Now()
	queued := make(chan error, 3)
	for range 3 {
		go func() { _, err := a.Acquire(ctx); queued <- err }()
	}
	for range 3 {
		if err := <-queued; !errors.Is(err, ErrQueueTimeout) {
			t.Fatalf("queued: %v, want ErrQueueTimeout", err)
		}
	}
	if el := time.Since(start); el > time.Second {
		t.Fatalf("timeout took %v", el)
	}
	if a.Waiting() != 0 {
		t.Fatalf("%d waiters left", a.Waiting())
	}
	// Tokens come back on release, exactly once.
	r1()
	r1()
	r3, err := a.Acquire(ctx)
	if err != nil {
		t.Fatal("released token not reusable:", err)
	}
	if _, err := a.Acquire(ctx); err == nil {
		t.Fatal("double release returned two tokens")
	}
	r3()
}

// sglang-router 0.3.2, measured: 1 token, 1 token/s, queue 1, 1 s queue
// timeout, a 2 s request holding the token: every waiter gets 408 at 1 s,
// since the refilled token lands exactly on their deadline.
func TestAdmissionRefillOnTheDeadlineIsTooLate(t *testing.T) {
	a := NewAdmission(AdmissionConfig{MaxConcurrent: 1, RatePerSecond: 1, QueueSize: 1, QueueTimeout: time.Second})
	rel, err := a.Acquire(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer rel()
	start := time.Now()
	errs := make(chan error, 3)
	for range 3 {
		go func() {
			r, err := a.Acquire(context.Background())
			if err == nil {
				r()
			}
			errs <- err
		}()
	}
	for range 3 {
		if err := <-errs; !errors.Is(err, ErrQueueTimeout) {
			t.Errorf("waiter: %v, want ErrQueueTimeout", err)
		}
	}
	if el := time.Since(start); el < 900*time.Millisecond || el > 1500*time.Millisecond {
		t.Errorf("408s after %v, want about 1 s", el)
	}
}

func TestAdmissionReleaseWakesWaiterFIFO(t *testing.T) {
	a := newTestAdmission(1, 2, 5*time.Second)
	ctx := context.Background()
	r, _ := a.Acquire(ctx)
	order := make(chan int, 2)
	for i := range 2 {
		go func() {
			rel, err := a.Acquire(ctx)
			if err != nil {
				order <- -1
				return
			}
			order <- i
			rel()
		}()
		for a.Waiting() != i+1 {
			time.Sleep(time.Millisecond)
		}
	}
	r()
	if a, b := <-order, <-order; a != 0 || b != 1 {
		t.Fatalf("served %d then %d, want FIFO 0 then 1", a, b)
	}
}

// A waiter waits no longer than the refill needs for its token (1/5 s
// here), even with a long queue timeout, as 0.3.2's TokenBucket::acquire;
// a token given back within that time serves it.
func TestAdmissionWaitIsBoundedByRefillTime(t *testing.T) {
	a := NewAdmission(AdmissionConfig{MaxConcurrent: 1, RatePerSecond: 5, QueueSize: 1, QueueTimeout: 10 * time.Second})
	rel, err := a.Acquire(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if _, err := a.Acquire(context.Background()); !errors.Is(err, ErrQueueTimeout) {
		t.Fatalf("waiter: %v, want ErrQueueTimeout", err)
	}
	if el := time.Since(start); el < 150*time.Millisecond || el > time.Second {
		t.Fatalf("gave up after %v, want about 200 ms", el)
	}
	time.Sleep(250 * time.Millisecond) // a token refills
	rel2, err := a.Acquire(context.Background())
	if err != nil {
		t.Fatal("refilled token:", err)
	}
	served := make(chan error, 1)
	go func() {
		r, err := a.Acquire(context.Background())
		if err == nil {
			r()
		}
		served <- err
	}()
	for a.Waiting() == 0 {
		time.Sleep(time.Millisecond)
	}
	rel2()
	if err := <-served; err != nil {
		t.Errorf("waiter not served by a release: %v", err)
	}
	rel()
}

func TestAdmissionNoQueueAndCancel(t *testing.T) {
	a := newTestAdmission(1, 0, time.Second)
	a.Acquire(context.Background())
	if _, err := a.Acquire(context.Background()); !errors.Is(err, ErrQueueFull) {
		t.Fatalf("queue size 0: %v, want ErrQueueFull", err)
	}
	b := newTestAdmission(1, 1, time.Minute)
	b.Acquire(context.Background())
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	if _, err := b.Acquire(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("cancelled wait: %v", err)
	}
	if b.Waiting() != 0 {
		t.Fatal("cancelled waiter left in the queue")
	}
}

func TestAdmissionDisabled(t *testing.T) {
	a := NewAdmission(AdmissionConfig{MaxConcurrent: -1})
	if a != nil {
		t.Fatal("max-concurrent ≤ 0 must disable admission")
	}
	for range 1000 {
		rel, err := a.Acquire(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		rel()
	}
}

// A token refilled while the only waiter is past its deadline (its timer
// not run yet) serves the next arrival, which used to queue behind it
// with no time left and get 408 holding a free token.
func TestAdmissionExpiredWaiterDoesNotBlockFreeToken(t *testing.T) {
	var nanos atomic.Int64
	clock := func() time.Time { return time.Unix(0, nanos.Load()) }
	// 1/64 token/s: a token takes 64 s, far beyond any real timer here.
	a := NewAdmission(AdmissionConfig{MaxConcurrent: 1, RatePerSecond: 1.0 / 64, QueueSize: 1, QueueTimeout: 2 * time.Minute})
	a.now, a.last = clock, clock()
	rel, err := a.Acquire(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer rel()
	ctx, cancel := context.WithCancel(context.Background())
	first := make(chan error, 1)
	go func() { _, err := a.Acquire(ctx); first <- err }()
	for a.Waiting() != 1 {
		time.Sleep(time.Millisecond)
	}
	nanos.Add(int64(64 * time.Second)) // the token refills on the first waiter's deadline
	r2, err := a.Acquire(context.Background())
	if err != nil {
		t.Fatalf("arrival with a refilled token: %v, want it served", err)
	}
	r2()
	cancel()
	if err := <-first; err == nil {
		t.Fatal("waiter past its deadline was served")
	}
}
