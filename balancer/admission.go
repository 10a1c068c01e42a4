package balancer

import (
	"context"
	"errors"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// AdmissionConfig mirrors --max-concurrent-requests, --rate-limit-tokens-per-second,
// --queue-size and --queue-timeout-secs (spec §5.5).
type AdmissionConfig struct {
	MaxConcurrent int     // bucket capacity; ≤ 0 disables admission control
	RatePerSecond float64 // refill rate; ≤ 0 means MaxConcurrent
	QueueSize     int     // waiters allowed; 0 rejects at once
	QueueTimeout  time.Duration
}

var (
	// ErrQueueFull: no token and no room to wait (the router answers 429).
	ErrQueueFull = errors.New("admission: queue full")
	// ErrQueueTimeout: waited QueueTimeout without a token (the router answers 408).
	ErrQueueTimeout = errors.New("admission: queue timeout")
)

// Admission is sglang-router's token bucket: a request takes one token and
// gives it back when its response ends, while tokens also refill at a fixed
// rate, so it limits both concurrency and rate. Requests without a token
// wait in a bounded FIFO queue. A nil *Admission admits everything.
type Admission struct {
	cfg AdmissionConfig
	now func() time.Time

	mu      sync.Mutex
	tokens  float64
	last    time.Time
	waiters []*admissionWaiter
	timer   *time.Timer // wakes the queue when refill yields a token
}

type admissionWaiter struct {
	ch      chan struct{} // receives the granted token
	granted bool          // under Admission.mu
}

// NewAdmission returns nil (admit everything) when MaxConcurrent ≤ 0.
func NewAdmission(cfg AdmissionConfig) *Admission {
	if cfg.MaxConcurrent <= 0 {
		return nil
	}
	if cfg.RatePerSecond <= 0 {
		cfg.RatePerSecond = float64(cfg.MaxConcurrent)
	}
	a := &Admission{cfg: cfg, now: time.Now, tokens: float64(cfg.MaxConcurrent)}
	a.last = a.now()
	return a
}

func noRelease() {}

// Acquire takes a token, waiting in the queue if needed. The returned
// release gives the token back; call it once when the response has ended
// (extra calls are ignored).
func (a *Admission) Acquire(ctx context.Context) (release func(), err error) {
	if a == nil {
		return noRelease, nil
	}
	a.mu.Lock()
	a.refill()
	if len(a.waiters) == 0 && a.tokens >= 1 {
		a.tokens--
		a.mu.Unlock()
		return a.releaser(), nil
	}
	if len(a.waiters) >= a.cfg.QueueSize {
		a.mu.Unlock()
		return nil, ErrQueueFull
	}
	w := &admissionWaiter{ch: make(chan struct{}, 1)}
	a.waiters = append(a.waiters, w)
	a.armRefill()
	a.mu.Unlock()

	timeout := time.NewTimer(a.cfg.QueueTimeout)
	defer timeout.Stop()
	select {
	case <-w.ch:
		return a.releaser(), nil
	case <-timeout.C:
		err = ErrQueueTimeout
	case <-ctx.Done():
		err = ctx.Err()
	}
	a.mu.Lock()
	if w.granted { // the token arrived while we were giving up: hand it on
		a.putBack()
	} else {
		a.waiters = slices.DeleteFunc(a.waiters, func(x *admissionWaiter) bool { return x == w })
	}
	a.mu.Unlock()
	return nil, err
}

// Waiting is the current queue length.
func (a *Admission) Waiting() int {
	if a == nil {
		return 0
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.waiters)
}

func (a *Admission) releaser() func() {
	var done atomic.Bool
	return func() {
		if done.CompareAndSwap(false, true) {
			a.mu.Lock()
			a.putBack()
			a.mu.Unlock()
		}
	}
}

// putBack returns one token and serves the queue. Caller holds mu.
func (a *Admission) putBack() {
	a.refill()
	a.tokens = min(a.tokens+1, float64(a.cfg.MaxConcurrent))
	a.grant()
}

func (a *Admission) refill() {
	now := a.now()
	a.tokens = min(a.tokens+now.Sub(a.last).Seconds()*a.cfg.RatePerSecond, float64(a.cfg.MaxConcurrent))
	a.last = now
}

// grant hands whole tokens to waiters in FIFO order. Caller holds mu.
func (a *Admission) grant() {
	for len(a.waiters) > 0 && a.tokens >= 1 {
		w := a.waiters[0]
		a.waiters = a.waiters[1:]
		a.tokens--
		w.granted = true
		w.ch <- struct{}{}
	}
}

// armRefill schedules a wake-up for when the refill will have produced a
// token, so waiters are not served only by releases. Caller holds mu.
func (a *Admission) armRefill() {
	if a.timer != nil {
		return
	}
	wait := time.Duration((1 - a.tokens) / a.cfg.RatePerSecond * float64(time.Second))
	a.timer = time.AfterFunc(max(wait, time.Millisecond), func() {
		a.mu.Lock()
		defer a.mu.Unlock()
		a.timer = nil
		a.refill()
		a.grant()
		if len(a.waiters) > 0 {
			a.armRefill()
		}
	})
}
