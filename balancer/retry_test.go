package balancer

import (
	"testing"
	"time"
)

func TestRetryable(t *testing.T) {
	for _, s := range []int{408, 429, 500, 502, 503, 504} {
		if !Retryable(s) {
			t.Errorf("%d not retryable", s)
		}
	}
	for _, s := range []int{200, 400, 401, 404, 413, 501} {
		if Retryable(s) {
			t.Errorf("%d retryable", s)
		}
	}
}

func TestBackoffBounds(t *testing.T) {
	c := DefaultRetryConfig()
	for attempt, base := range []float64{50, 75, 112.5, 168.75} {
		lo, hi := time.Duration(base*0.8*1e6), time.Duration(base*1.2*1e6)+1
		for range 200 {
			if d := c.Backoff(attempt); d < lo || d > hi {
				t.Fatalf("attempt %d: %v outside [%v,%v]", attempt, d, lo, hi)
			}
		}
	}
	c.MaxBackoff = 100 * time.Millisecond
	c.Jitter = 0
	if d := c.Backoff(30); d != 100*time.Millisecond {
		t.Fatalf("capped backoff %v, want 100ms", d)
	}
	if (RetryConfig{MaxRetries: 0}).Attempts() != 1 {
		t.Fatal("disabled retries must still make one attempt")
	}
}
