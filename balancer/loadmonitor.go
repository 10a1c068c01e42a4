package balancer

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"sync"
	"time"
)

// loadMonitor polls GET /get_load on every worker for power_of_two
// (spec §4.3). Each reading is stored with the router's in-flight count at
// that moment, so Worker.EstimatedLoad can add what was routed since.
type loadMonitor struct {
	reg      *Registry
	client   *http.Client
	interval time.Duration
	timeout  time.Duration
}

func (lm *loadMonitor) run(ctx context.Context) {
	runNowAndEvery(ctx, lm.interval, func() { lm.poll(ctx) })
}

func (lm *loadMonitor) poll(ctx context.Context) {
	var wg sync.WaitGroup
	for _, w := range lm.reg.Snapshot().All {
		wg.Go(func() {
			n, err := FetchLoad(ctx, lm.client, w, lm.timeout)
			w.setReportedLoad(n, err == nil)
		})
	}
	wg.Wait()
}

// FetchLoad reads one worker's /get_load: the sum of num_tokens over
// SGLang's per-DP-rank array, or the older {"load": n}.
func FetchLoad(ctx context.Context, c *http.Client, w *Worker, timeout time.Duration) (int64, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	resp, err := get(ctx, c, w.URL+"/get_load", w.APIKey)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return 0, err
	}
	if resp.StatusCode/100 != 2 {
		return 0, &statusError{resp.StatusCode}
	}
	return parseLoad(body)
}

type statusError struct{ code int }

func (e *statusError) Error() string { return "status " + http.StatusText(e.code) }

type loadEntry struct {
	NumTokens *int64 `json:"num_tokens"`
	Load      *int64 `json:"load"`
}

func (e loadEntry) value() int64 {
	if e.NumTokens != nil {
		return *e.NumTokens
	}
	if e.Load != nil {
		return *e.Load
	}
	return 0
}

func parseLoad(body []byte) (int64, error) {
	var arr []loadEntry
	if err := json.Unmarshal(body, &arr); err == nil {
		var sum int64
		for _, e := range arr {
			sum += e.value()
		}
		return sum, nil
	}
	var one loadEntry
	if err := json.Unmarshal(body, &one); err != nil {
		return 0, err
	}
	return one.value(), nil
}
