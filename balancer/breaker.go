package balancer

import (
	"sync/atomic"
	"time"
)

// BreakerState is a circuit breaker state; the numbers match smg_worker_cb_state.
type BreakerState int

const (
	BreakerClosed   BreakerState = 0
	BreakerOpen     BreakerState = 1
	BreakerHalfOpen BreakerState = 2
)

func (s BreakerState) String() string {
	switch s {
	case BreakerOpen:
		return "open"
	case BreakerHalfOpen:
		return "half_open"
	default:
		return "closed"
	}
}

// BreakerConfig mirrors the --cb-* flags (the window duration is parsed but
// unused upstream, so it is absent here).
type BreakerConfig struct {
	FailureThreshold int
	SuccessThreshold int
	OpenDuration     time.Duration
	Disabled         bool
}

func DefaultBreakerConfig() BreakerConfig {
	return BreakerConfig{FailureThreshold: 10, SuccessThreshold: 3, OpenDuration: 60 * time.Second}
}

// Breaker is a per-worker circuit breaker counting consecutive outcomes
// (spec §5.3). State and both counters live in one word changed by CAS, so
// Allow on a closed breaker is a single atomic load.
type Breaker struct {
	cfg      BreakerConfig
	now      func() time.Time // injectable clock
	word     atomic.Uint64    // state<<62 | failures<<31 | successes
	openedAt atomic.Int64     // unix nanos; written before the CAS that opens
	okTotal  atomic.Uint64    // every success ever, read by passive health

	// Set before the worker is published; nil means no metrics.
	onTransition func(from, to BreakerState)
	onOutcome    func(success bool)
}

const counterMask = 1<<31 - 1

func pack(s BreakerState, fails, oks uint64) uint64 {
	return uint64(s)<<62 | min(fails, counterMask)<<31 | min(oks, counterMask)
}

func unpack(v uint64) (BreakerState, uint64, uint64) {
	return BreakerState(v >> 62), v >> 31 & counterMask, v & counterMask
}

func NewBreaker(cfg BreakerConfig) *Breaker {
	cfg.FailureThreshold = max(cfg.FailureThreshold, 1)
	cfg.SuccessThreshold = max(cfg.SuccessThreshold, 1)
	return &Breaker{cfg: cfg, now: time.Now}
}

// Allow reports whether a request may go to the worker, moving open to
// half-open once the open duration has passed.
func (b *Breaker) Allow() bool {
	if b.cfg.Disabled {
		return true
	}
	v := b.word.Load()
	if st, _, _ := unpack(v); st != BreakerOpen {
		return true
	}
	if b.now().UnixNano()-b.openedAt.Load() < int64(b.cfg.OpenDuration) {
		return false
	}
	if b.word.CompareAndSwap(v, pack(BreakerHalfOpen, 0, 0)) {
		b.transition(BreakerOpen, BreakerHalfOpen)
	}
	return true
}

// Record feeds one request outcome into the breaker. What counts as success
// is the caller's call (PD: 2xx or 4xx; regular: 2xx).
func (b *Breaker) Record(success bool) {
	if success {
		b.okTotal.Add(1)
	}
	if b.onOutcome != nil {
		b.onOutcome(success)
	}
	if b.cfg.Disabled {
		return
	}
	for {
		v := b.word.Load()
		st, fails, oks := unpack(v)
		next := st
		var nv uint64
		switch {
		case st == BreakerOpen:
			return // a late outcome of a request admitted before opening
		case success && st == BreakerClosed:
			if fails == 0 {
				return // common case: no write, no contention
			}
			nv = pack(BreakerClosed, 0, 0)
		case success: // half-open
			if oks+1 >= uint64(b.cfg.SuccessThreshold) {
				next, nv = BreakerClosed, pack(BreakerClosed, 0, 0)
			} else {
				nv = pack(BreakerHalfOpen, 0, oks+1)
			}
		case st == BreakerHalfOpen || fails+1 >= uint64(b.cfg.FailureThreshold):
			next, nv = BreakerOpen, pack(BreakerOpen, 0, 0)
			b.openedAt.Store(b.now().UnixNano())
		default:
			nv = pack(BreakerClosed, fails+1, 0)
		}
		if b.word.CompareAndSwap(v, nv) {
			if next != st {
				b.transition(st, next)
			}
			return
		}
	}
}

// State is the current state without the open → half-open move Allow makes.
func (b *Breaker) State() BreakerState {
	st, _, _ := unpack(b.word.Load())
	return st
}

// Counts returns the consecutive failures and successes.
func (b *Breaker) Counts() (failures, successes int) {
	_, f, s := unpack(b.word.Load())
	return int(f), int(s)
}

// successes is the total of successful outcomes, used as a passive health
// signal: a worker completing requests is alive even if its probe is slow.
func (b *Breaker) successes() uint64 { return b.okTotal.Load() }

func (b *Breaker) transition(from, to BreakerState) {
	if b.onTransition != nil {
		b.onTransition(from, to)
	}
}
