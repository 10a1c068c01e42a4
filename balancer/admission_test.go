package balancer

import (
	"context"
	"errors"
	"testing"
	"time"
)

// rate 1e-6/s: no refill within a test, so only releases free tokens.
func newTestAdmission(capacity, queue int, timeout time.Duration) *Admission {
	return NewAdmission(AdmissionConfig{MaxConcurrent: capacity, RatePerSecond: 1e-6, QueueSize: queue, QueueTimeout: timeout})
}

func TestAdmissionQueueFullAndTimeout(t *testing.T) {
	a := newTestAdmission(2, 1, 50*time.Millisecond)
	ctx := context.Background()
	r1, err1 := a.Acquire(ctx)
	_, err2 := a.Acquire(ctx)
	if err1 != nil || err2 != nil {
		t.Fatal(err1, err2)
	}
	queued := make(chan error, 1)
	go func() { _, err := a.Acquire(ctx); queued <- err }()
	for a.Waiting() == 0 {
		time.Sleep(time.Millisecond)
	}
	if _, err := a.Acquire(ctx); !errors.Is(err, ErrQueueFull) {
		t.Fatalf("full queue: %v, want ErrQueueFull", err)
	}
	start := time.Now()
	if err := <-queued; !errors.Is(err, ErrQueueTimeout) {
		t.Fatalf("queued: %v, want ErrQueueTimeout", err)
	}
	if el := time.Since(start); el > time.Second {
		t.Fatalf("timeout took %v", el)
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

func TestAdmissionRefillServesQueue(t *testing.T) {
	a := NewAdmission(AdmissionConfig{MaxConcurrent: 1, RatePerSecond: 50, QueueSize: 1, QueueTimeout: 2 * time.Second})
	if _, err := a.Acquire(context.Background()); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if _, err := a.Acquire(context.Background()); err != nil {
		t.Fatal("refill did not serve the queue:", err)
	}
	if el := time.Since(start); el > time.Second {
		t.Fatalf("refill at 50/s took %v", el)
	}
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
