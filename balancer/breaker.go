package balancer

import (
	"sync"
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

// BreakerConfig mirrors the --cb-* and --outlier-* flags (the window
// duration is parsed but unused upstream, so it is absent here). The
// breaker is the router's outlier detection, as Envoy's: consecutive
// failures (5xx, connect failures, timeouts, broken bodies) or a confirmed
// stall eject a worker; the k-th ejection in a row lasts k × OpenDuration
// (base_ejection_time) up to MaxOpenDuration (max_ejection_time), unless
// health probes end it sooner (recoveryDue, probed); and no worker is
// ejected while MaxEjectionPercent of its pool is unavailable.
type BreakerConfig struct {
	FailureThreshold int
	SuccessThreshold int
	OpenDuration     time.Duration
	MaxOpenDuration  time.Duration // <= OpenDuration: every ejection lasts OpenDuration
	// MaxEjectionPercent caps the unavailable share of a pool (ejected or
	// unhealthy workers) below which one more may be ejected, as Envoy's
	// max_ejection_percent: a lone worker can be, of two only one. 0 or
	// 100 and more: no cap.
	MaxEjectionPercent int
	// StallTimeout: a worker with requests waiting this long for a reply
	// head, none answered and no probe passed meanwhile, is suspect
	// (policies steer around it) and is ejected if its probe failed too;
	// a failing probe makes it suspect sooner (outlier.go). 0: off.
	StallTimeout time.Duration
	Disabled     bool
}

func DefaultBreakerConfig() BreakerConfig {
	return BreakerConfig{FailureThreshold: 10, SuccessThreshold: 3, OpenDuration: 60 * time.Second,
		MaxOpenDuration: 300 * time.Second, MaxEjectionPercent: 50, StallTimeout: 10 * time.Second}
}

// Breaker is a per-worker circuit breaker counting consecutive outcomes
// (spec §5.3). State and both counters live in one word changed by CAS, so
// Allow on a closed breaker is a single atomic load. Opening (ejecting) is
// rare and serialised by ejectMu, so the pool's share is checked and the
// breaker opened as one step.
type Breaker struct {
	cfg      BreakerConfig
	word     atomic.Uint64 // state<<62 | failures<<31 | successes
	openedAt atomic.Int64  // unix nanos; written before the CAS that opens
	openFor  atomic.Int64  // this ejection's duration; written with openedAt
	gated    atomic.Bool   // stays open past openFor until a probe passes: a stall, or a recovery probe failed
	byStall  atomic.Bool   // this ejection is for a stall; written with openedAt
	streak   atomic.Int64  // this ejection's place in a row (the back-off k); written with openedAt
	okTotal  atomic.Uint64 // every success ever, read by passive health
	trialAt  atomic.Int64  // unix nanos a half-open trial was last offered

	// Under ejectMu: ejections in a row (the back-off multiplier) and when
	// the breaker last closed, from which the multiplier decays.
	ejections int64
	closedAt  int64

	pool atomic.Pointer[poolRef] // the pool the worker serves in; nil = no ejection cap
	out  outlierState            // replies awaited and answered (outlier.go)

	// Set before the worker is published; nil means no metrics.
	onTransition func(from, to BreakerState)
	onOutcome    func(success bool)
	onEject      func(reason string, enforced bool)
}

// Ejection reasons, the values of the metrics' reason label.
const (
	ejectFailures = "consecutive_failures"
	ejectStall    = "stall"
)

// ejectMu serialises ejection decisions, so two breakers of one pool
// cannot both take its last unavailable share.
var ejectMu sync.Mutex

// poolRef is where a breaker's worker serves: its registry and type.
type poolRef struct {
	reg *Registry
	typ WorkerType
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
	return &Breaker{cfg: cfg}
}

// Allow reports whether a request may go to the worker, moving open to
// half-open once the open duration has passed. Half-open admits one trial
// at a time (trialsFree), so a worker that still does not answer holds one
// request, not its share of traffic.
func (b *Breaker) Allow() bool {
	if b.cfg.Disabled {
		return true
	}
	v := b.word.Load()
	switch st, _, _ := unpack(v); st {
	case BreakerClosed:
		return true
	case BreakerHalfOpen:
		return b.trialsFree()
	}
	if !b.expired(time.Now().UnixNano()) || b.gated.Load() {
		return false
	}
	if b.word.CompareAndSwap(v, pack(BreakerHalfOpen, 0, 0)) {
		b.transition(BreakerOpen, BreakerHalfOpen)
	}
	return b.trialsFree()
}

// trialsFree offers a half-open breaker's one trial: to one caller at a
// time, while no request waits for a reply head, and then not again for
// trialHold, which covers the pick and the send that follow (so callers
// racing each other cannot all take it). A pick that chose another
// worker leaves the trial unused until then.
func (b *Breaker) trialsFree() bool {
	if b.out.awaiting.Load() != 0 {
		return false
	}
	now, last := time.Now().UnixNano(), b.trialAt.Load()
	return now-last >= int64(trialHold) && b.trialAt.CompareAndSwap(last, now)
}

// trialHold: see trialsFree.
const trialHold = 100 * time.Millisecond

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
			if b.eject(v, ejectFailures) {
				return
			}
			continue
		default:
			nv = pack(BreakerClosed, fails+1, 0)
		}
		if b.word.CompareAndSwap(v, nv) {
			if next != st {
				b.transition(st, next)
				if next == BreakerClosed {
					b.closed()
				}
			}
			return
		}
	}
}

// eject opens the breaker from word v (closed or half-open), unless the
// pool's unavailable share is at the cap: then a failure leaves the
// breaker closed one failure short of asking again, and a stall changes
// nothing. It reports false when v changed under it (read it again).
func (b *Breaker) eject(v uint64, reason string) bool {
	ejectMu.Lock()
	defer ejectMu.Unlock()
	st, _, _ := unpack(v)
	now := time.Now().UnixNano()
	if !b.pool.Load().mayEject(b, now) {
		if reason == ejectFailures {
			if !b.word.CompareAndSwap(v, pack(BreakerClosed, uint64(b.cfg.FailureThreshold-1), 0)) {
				return false
			}
			if st != BreakerClosed {
				b.closedAt = now // the back-off decays from here, not from an earlier close
				b.transition(st, BreakerClosed)
			}
		}
		b.ejected(reason, false)
		return true
	}
	k := b.ejections
	if st == BreakerClosed && b.closedAt > 0 && b.cfg.OpenDuration > 0 {
		k = max(0, k-(now-b.closedAt)/int64(b.cfg.OpenDuration)) // one step back per base time spent closed
	}
	b.openedAt.Store(now)
	b.openFor.Store(b.ejectionTime(k + 1))
	if !b.word.CompareAndSwap(v, pack(BreakerOpen, 0, 0)) {
		return false
	}
	b.ejections = k + 1
	b.streak.Store(k + 1)
	b.byStall.Store(reason == ejectStall)
	b.gated.Store(reason == ejectStall)
	b.transition(st, BreakerOpen)
	b.ejected(reason, true)
	return true
}

// ejectionTime is the k-th ejection in a row's: k base times, capped.
func (b *Breaker) ejectionTime(k int64) int64 {
	return min(int64(b.cfg.OpenDuration)*k, max(int64(b.cfg.MaxOpenDuration), int64(b.cfg.OpenDuration)))
}

func (b *Breaker) expired(now int64) bool { return now-b.openedAt.Load() >= b.openFor.Load() }

// recoveryDue reports whether the ejection, which began at opened, has
// waited long enough at now for a health probe to end it: a stall
// ejection its whole time; the k-th failure ejection in a row base ×
// 2^(k-1) of it (base: the detector's sweep period), so that a worker
// whose fault outside it (a restarted kvproxy) has passed takes a trial
// within about the outage's length, not the whole ejection time.
func (b *Breaker) recoveryDue(now int64, base time.Duration) (opened int64, due bool) {
	if b.State() != BreakerOpen {
		return 0, false
	}
	opened = b.openedAt.Load()
	wait := b.openFor.Load()
	if !b.byStall.Load() {
		wait = min(wait, int64(base)<<min(max(b.streak.Load()-1, 0), 32))
	}
	return opened, now-opened >= wait
}

// probed applies a recovery probe's verdict to the ejection that began at
// opened: a pass ends it (the next Allow goes half-open), a failure holds
// it open until one passes, past its time if need be: recovery follows
// the health of what failed.
func (b *Breaker) probed(opened int64, ok bool) {
	ejectMu.Lock()
	defer ejectMu.Unlock()
	if b.State() != BreakerOpen || b.openedAt.Load() != opened {
		return // over, or a later ejection: not what was probed
	}
	b.gated.Store(!ok)
	if ok {
		b.openFor.Store(min(b.openFor.Load(), time.Now().UnixNano()-opened))
	}
}

// Eject opens a closed or half-open breaker at once (a stall confirmed by a
// failed probe), within the pool's cap; it reports whether it did.
func (b *Breaker) Eject() bool {
	if b.cfg.Disabled {
		return false
	}
	for {
		v := b.word.Load()
		if st, _, _ := unpack(v); st == BreakerOpen {
			return false
		}
		if b.eject(v, ejectStall) {
			return b.State() == BreakerOpen
		}
	}
}

// closed notes when the breaker closed, from which the back-off decays.
func (b *Breaker) closed() {
	ejectMu.Lock()
	b.closedAt = time.Now().UnixNano()
	ejectMu.Unlock()
}

// isEjected reports whether the breaker keeps its worker out at now.
func (b *Breaker) isEjected(now int64) bool {
	return b.State() == BreakerOpen && (b.gated.Load() || !b.expired(now))
}

// mayEject reports whether b's worker may be ejected at now: the pool's
// other unavailable workers are below the cap. Caller holds ejectMu.
func (p *poolRef) mayEject(b *Breaker, now int64) bool {
	pct := b.cfg.MaxEjectionPercent
	if p == nil || pct <= 0 || pct >= 100 {
		return true
	}
	ws := p.reg.Snapshot().ByType[p.typ]
	out := 0
	for _, w := range ws {
		if w.Breaker != b && (!w.Healthy() || w.Breaker != nil && w.Breaker.isEjected(now)) {
			out++
		}
	}
	return out*100 < pct*len(ws)
}

// joinPool makes the breaker count its pool's share before ejecting.
func (b *Breaker) joinPool(reg *Registry, typ WorkerType) {
	if b != nil && b.pool.Load() == nil {
		b.pool.Store(&poolRef{reg: reg, typ: typ})
	}
}

func (b *Breaker) ejected(reason string, enforced bool) {
	if b.onEject != nil {
		b.onEject(reason, enforced)
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
