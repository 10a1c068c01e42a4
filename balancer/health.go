package balancer

import (
	"context"
	"io"
	"net/http"
	"sync"
	"time"
)

// HealthConfig mirrors the --health-* flags (spec §5.2).
type HealthConfig struct {
	Endpoint         string
	Interval         time.Duration
	Timeout          time.Duration
	FailureThreshold int
	SuccessThreshold int
	Disabled         bool
}

func DefaultHealthConfig() HealthConfig {
	return HealthConfig{Endpoint: "/health", Interval: 60 * time.Second, Timeout: 5 * time.Second, FailureThreshold: 3, SuccessThreshold: 2}
}

// healthChecker probes every registered worker each interval (the first
// round at once) and flips Healthy after consecutive failures or successes.
// It never touches breakers. A failed probe still counts as a success when
// the worker completed a request since the previous probe, so a busy engine
// that answers /health slowly is not evicted while it serves traffic.
type healthChecker struct {
	cfg     HealthConfig
	reg     *Registry
	client  *http.Client
	metrics *Metrics
}

// run probes until ctx ends.
func (h *healthChecker) run(ctx context.Context) {
	runNowAndEvery(ctx, h.cfg.Interval, func() { h.round(ctx) })
}

// round probes all workers concurrently and applies the results.
func (h *healthChecker) round(ctx context.Context) {
	var wg sync.WaitGroup
	for _, w := range h.reg.Snapshot().All {
		if w.DisableHealthCheck {
			continue
		}
		wg.Go(func() { h.apply(w, probe(ctx, h.client, w, h.cfg.Endpoint, h.cfg.Timeout)) })
	}
	wg.Wait()
}

func (h *healthChecker) apply(w *Worker, ok bool) {
	st := w.st
	if w.Breaker != nil {
		seen := w.Breaker.successes()
		if !ok && seen != st.passiveSeen.Load() {
			ok = true
		}
		st.passiveSeen.Store(seen)
	}
	h.metrics.healthCheck(w, ok)
	if w.Breaker != nil {
		w.Breaker.out.probed(ok, time.Now().UnixNano())
	}
	if ok {
		st.probeFails.Store(0)
		if !w.Healthy() && st.probeOKs.Add(1) >= int32(h.cfg.SuccessThreshold) {
			st.probeOKs.Store(0)
			w.SetHealthy(true)
		}
		return
	}
	st.probeOKs.Store(0)
	if w.Healthy() && st.probeFails.Add(1) >= int32(h.cfg.FailureThreshold) {
		st.probeFails.Store(0)
		w.SetHealthy(false)
	}
}

// probe GETs url+path and reports whether the answer was 2xx in time.
func probe(ctx context.Context, c *http.Client, w *Worker, path string, timeout time.Duration) bool {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	resp, err := get(ctx, c, w.BaseURL+path, w.APIKey)
	if err != nil {
		return false
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10)) // keep the connection reusable
	resp.Body.Close()
	return resp.StatusCode >= 200 && resp.StatusCode < 300
}

func get(ctx context.Context, c *http.Client, url, apiKey string) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	if apiKey != "" {
		req.Header.Set("Authorization", "Bearer "+apiKey)
	}
	return c.Do(req)
}
