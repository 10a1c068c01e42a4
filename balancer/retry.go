package balancer

import (
	"math"
	"math/rand/v2"
	"time"
)

// RetryConfig mirrors the --retry-* flags (spec §2.7, §5.4).
type RetryConfig struct {
	MaxRetries     int // total attempts, not extra ones; < 1 counts as 1
	InitialBackoff time.Duration
	MaxBackoff     time.Duration
	Multiplier     float64
	Jitter         float64 // fraction in [0,1]
}

func DefaultRetryConfig() RetryConfig {
	return RetryConfig{MaxRetries: 5, InitialBackoff: 50 * time.Millisecond, MaxBackoff: 30 * time.Second, Multiplier: 1.5, Jitter: 0.2}
}

// Attempts is the number of tries a request gets (--disable-retries → 1).
func (c RetryConfig) Attempts() int { return max(c.MaxRetries, 1) }

// Retryable reports whether an upstream status warrants another attempt.
func Retryable(status int) bool {
	switch status {
	case 408, 429, 500, 502, 503, 504:
		return true
	}
	return false
}

// Backoff is the delay before attempt+1, attempt counting from 0 for the
// delay after the first try: min(initial·mult^attempt, max) ± jitter·delay.
func (c RetryConfig) Backoff(attempt int) time.Duration {
	d := float64(c.InitialBackoff) * math.Pow(c.Multiplier, float64(attempt))
	d = min(d, float64(c.MaxBackoff))
	if c.Jitter > 0 {
		d += d * c.Jitter * (2*rand.Float64() - 1)
	}
	return time.Duration(max(d, 0))
}
