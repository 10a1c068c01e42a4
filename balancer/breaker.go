package balancer

import (
	"sync"
	"time"
)

// BreakerState is a circuit breaker state; the numbers match smg_worker_cb_state.
type BreakerState int

const (
	BreakerClosed   BreakerState = 0
	BreakerOpen     BreakerState = 1
	BreakerHalfOpen BreakerState = 2
)

// BreakerConfig mirrors the --cb-* flags.
type BreakerConfig struct {
	FailureThreshold int
	SuccessThreshold int
	OpenDuration     time.Duration
	Disabled         bool
}

func DefaultBreakerConfig() BreakerConfig {
	return BreakerConfig{FailureThreshold: 10, SuccessThreshold: 3, OpenDuration: 60 * time.Second}
}

// Breaker is a per-worker circuit breaker counting consecutive outcomes.
// TODO(balancer issue): lock-free state and metrics hooks.
type Breaker struct {
	cfg BreakerConfig

	mu        sync.Mutex
	state     BreakerState
	failures  int
	successes int
	openedAt  time.Time
}

func NewBreaker(cfg BreakerConfig) *Breaker { return &Breaker{cfg: cfg} }

// Allow reports whether a request may go to the worker, moving open to
// half-open once the open duration has passed.
func (b *Breaker) Allow() bool {
	if b.cfg.Disabled {
		return true
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.state == BreakerOpen && time.Since(b.openedAt) >= b.cfg.OpenDuration {
		b.state, b.failures, b.successes = BreakerHalfOpen, 0, 0
	}
	return b.state != BreakerOpen
}

// Record feeds one request outcome into the breaker.
func (b *Breaker) Record(success bool) {
	if b.cfg.Disabled {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if success {
		b.failures = 0
		if b.state == BreakerHalfOpen {
			b.successes++
			if b.successes >= b.cfg.SuccessThreshold {
				b.state, b.successes = BreakerClosed, 0
			}
		}
		return
	}
	b.successes = 0
	b.failures++
	if b.state == BreakerHalfOpen || b.failures >= b.cfg.FailureThreshold {
		b.state, b.openedAt, b.failures = BreakerOpen, time.Now(), 0
	}
}

func (b *Breaker) State() BreakerState {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.state
}
