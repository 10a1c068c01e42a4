package loadgen

import (
	"math"
	"math/rand/v2"
	"time"
)

// Schedule returns when to send each of n requests, as offsets from the start of the run:
// all at once when rate is +Inf or ≤ 0 (a burst), else a Poisson process of that many requests per
// second (exponential gaps drawn from r).
func Schedule(r *rand.Rand, n int, rate float64) []time.Duration {
	at := make([]time.Duration, n)
	if rate <= 0 || math.IsInf(rate, 1) {
		return at
	}
	t := 0.0
	for i := range at {
		at[i] = time.Duration(t * float64(time.Second))
		t += r.ExpFloat64() / rate
	}
	return at
}

// TraceSchedule sends each request at its trace timestamp.
func TraceSchedule(rs []Request) []time.Duration {
	at := make([]time.Duration, len(rs))
	for i := range rs {
		at[i] = rs[i].At
	}
	return at
}
