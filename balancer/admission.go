package balancer

import (
	"context"
	"errors"
	"math"
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
	// ErrQueueFull: no token and no queue (the router answers 429).
	ErrQueueFull = errors.New("admission: queue full")
	// ErrQueueTimeout: waited without getting a token (the router answers 408).
	ErrQueueTimeout = errors.New("admission: queue timeout")
)

// Admission is sglang-router's token bucket: a request takes one token and
// gives it back when its response ends, while tokens also refill at a fixed
// rate, so it limits both concurrency and rate. A nil *Admission admits
// everything.
//
// Requests without a token wait as in 0.3.2 (src/middleware.rs,
// core/token_bucket.rs), measured against it: the --queue-size queue is a
// channel one task drains at once, so it never holds back a waiting
// request and only --queue-size 0 answers 429; a waiter gives up (408)
// after --queue-timeout-secs or, sooner, after the time the refill needs to
// produce the token it lacked on arrival (TokenBucket::acquire's own
// timeout), so it is served by a token given back before then, and a refill
// landing on its deadline comes too late. Waiters are served FIFO.
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
	ch       chan struct{} // receives the granted token
	granted  bool          // under Admission.mu
	deadline time.Time     // no token from then on: it times out
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
	a.grant() // waiters first; drops those past their deadline, which must not hold this one back
	if len(a.waiters) == 0 && a.tokens >= 1 {
		a.tokens--
		a.mu.Unlock()
		return a.releaser(), nil
	}
	if a.cfg.QueueSize == 0 {
		a.mu.Unlock()
		return nil, ErrQueueFull
	}
	wait := min(a.cfg.QueueTimeout, a.refillTime())
	w := &admissionWaiter{ch: make(chan struct{}, 1), deadline: a.last.Add(wait)}
	a.waiters = append(a.waiters, w)
	a.armRefill()
	a.mu.Unlock()

	timeout := time.NewTimer(wait)
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

// grant hands whole tokens to waiters in FIFO order, passing over those
// whose deadline has come (their own timer takes them out). Caller holds
// mu, after refill.
func (a *Admission) grant() {
	for len(a.waiters) > 0 && a.tokens >= 1 {
		w := a.waiters[0]
		a.waiters = a.waiters[1:]
		if !a.last.Before(w.deadline) {
			continue
		}
		a.tokens--
		w.granted = true
		w.ch <- struct{}{}
	}
}

// refillTime is how long the refill takes to make a whole token. Caller
// holds mu, after refill.
func (a *Admission) refillTime() time.Duration {
	secs := max(1-a.tokens, 0) / a.cfg.RatePerSecond
	if secs >= float64(math.MaxInt64/int64(time.Second)) {
		return time.Duration(math.MaxInt64)
	}
	return time.Duration(secs * float64(time.Second))
}

// armRefill schedules a wake-up for when the refill will have produced a
// token, for waiters whose deadline is later. Caller holds mu.
func (a *Admission) armRefill() {
	if a.timer != nil {
		return
	}
	wait := a.refillTime()
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
