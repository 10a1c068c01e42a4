package balancer

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strconv"
	"sync"
	"time"
)

// loadMonitor polls every worker's load (FetchLoad) for power_of_two
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

// FetchLoad reads one worker's load: SGLang's GET /v1/loads?include=core
// (sgl-project/sglang#16976), or for an engine without it (404 or 405, then
// remembered) the deprecated /get_load. A DP rank's worker (--dp-aware)
// asks for its rank (dp_rank=) and counts only that rank's entries.
func FetchLoad(ctx context.Context, c *http.Client, w *Worker, timeout time.Duration) (int64, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	rank := -1
	if w.DPSize > 0 {
		rank = w.DPRank
	}
	if !w.st.legacyLoad.Load() {
		path := "/v1/loads?include=core"
		if rank >= 0 {
			path += "&dp_rank=" + strconv.Itoa(rank)
		}
		body, status, err := getBody(ctx, c, w, path)
		switch {
		case err != nil:
			return 0, err
		case status == http.StatusNotFound || status == http.StatusMethodNotAllowed:
			w.st.legacyLoad.Store(true)
		case status/100 != 2:
			return 0, &statusError{status}
		default:
			return parseLoads(body, rank)
		}
	}
	body, status, err := getBody(ctx, c, w, "/get_load")
	if err != nil {
		return 0, err
	}
	if status/100 != 2 {
		return 0, &statusError{status}
	}
	return parseLoad(body, rank)
}

func getBody(ctx context.Context, c *http.Client, w *Worker, path string) ([]byte, int, error) {
	resp, err := get(ctx, c, w.BaseURL+path, w.APIKey)
	if err != nil {
		return nil, 0, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	return body, resp.StatusCode, err
}

// rankLoad is one DP rank of /v1/loads. num_total_tokens (used tokens plus
// pending prefill, what SGLang balances its DP ranks by) is preferred;
// older 0.5.x releases report num_used_tokens only.
type rankLoad struct {
	DPRank         json.RawMessage `json:"dp_rank"`
	NumTotalTokens *int64          `json:"num_total_tokens"`
	NumUsedTokens  *int64          `json:"num_used_tokens"`
}

// ofRank reports whether an entry whose dp_rank is entry counts towards
// rank (-1: every rank); an entry that names no rank counts for all.
func ofRank(entry json.RawMessage, rank int) bool {
	return rank < 0 || len(entry) == 0 || string(entry) == "null" || string(entry) == strconv.Itoa(rank)
}

// parseLoads sums the ranks of a /v1/loads reply (only rank's when >= 0).
func parseLoads(body []byte, rank int) (int64, error) {
	var v struct {
		Loads *[]rankLoad `json:"loads"`
	}
	if err := json.Unmarshal(body, &v); err != nil {
		return 0, err
	}
	if v.Loads == nil {
		return 0, errors.New("/v1/loads reply has no loads")
	}
	var sum int64
	for _, r := range *v.Loads {
		if !ofRank(r.DPRank, rank) {
			continue
		}
		switch {
		case r.NumTotalTokens != nil:
			sum += *r.NumTotalTokens
		case r.NumUsedTokens != nil:
			sum += *r.NumUsedTokens
		}
	}
	return sum, nil
}

type statusError struct{ code int }

func (e *statusError) Error() string { return "status " + http.StatusText(e.code) }

type loadEntry struct {
	DPRank    json.RawMessage `json:"dp_rank"`
	NumTokens *int64          `json:"num_tokens"`
	Load      *int64          `json:"load"`
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

// parseLoad reads /get_load: a list of per-rank entries (only rank's
// counted when >= 0) or, from older engines, one object.
func parseLoad(body []byte, rank int) (int64, error) {
	var arr []loadEntry
	if err := json.Unmarshal(body, &arr); err == nil {
		var sum int64
		for _, e := range arr {
			if ofRank(e.DPRank, rank) {
				sum += e.value()
			}
		}
		return sum, nil
	}
	var one loadEntry
	if err := json.Unmarshal(body, &one); err != nil {
		return 0, err
	}
	return one.value(), nil
}
