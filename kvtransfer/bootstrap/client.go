package bootstrap

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"sync"
	"time"
)

// Resolver turns a bootstrap address into the prefill engine's peer address
// the way SGLang's decode does: topology first (retried while it is 503),
// then rank 0's address. Results are cached briefly per bootstrap address.
type Resolver struct {
	Client *http.Client
	TTL    time.Duration
	// PageSize and Dtype, if set, must match the prefill's topology.
	PageSize int
	Dtype    string

	mu    sync.Mutex
	cache map[string]cached
}

type cached struct {
	addr string
	at   time.Time
}

// NewResolver uses SGLang's 5 s HTTP timeout and a 5 s cache.
func NewResolver(pageSize int, dtype string) *Resolver {
	return &Resolver{Client: &http.Client{Timeout: 5 * time.Second}, TTL: 5 * time.Second, PageSize: pageSize, Dtype: dtype, cache: map[string]cached{}}
}

// Resolve implements kvtransfer.Config.Resolve.
func (r *Resolver) Resolve(ctx context.Context, bootstrapAddr string) (string, error) {
	r.mu.Lock()
	c, ok := r.cache[bootstrapAddr]
	r.mu.Unlock()
	if ok && time.Since(c.at) < r.TTL {
		return c.addr, nil
	}
	base := "http://" + bootstrapAddr
	var topo Topology
	for backoff := 20 * time.Millisecond; ; backoff = min(2*backoff, time.Second) {
		code, err := r.get(ctx, base+"/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1", &topo)
		if err == nil {
			break
		}
		if code != http.StatusServiceUnavailable {
			return "", err
		}
		select {
		case <-ctx.Done():
			return "", fmt.Errorf("%w (last: %v)", ctx.Err(), err)
		case <-time.After(backoff):
		}
	}
	if r.PageSize != 0 && topo.PageSize != r.PageSize {
		return "", fmt.Errorf("prefill page size %d, ours %d", topo.PageSize, r.PageSize)
	}
	if r.Dtype != "" && topo.KVCacheDtype != r.Dtype {
		return "", fmt.Errorf("prefill kv dtype %q, ours %q", topo.KVCacheDtype, r.Dtype)
	}
	var a RankAddr
	if _, err := r.get(ctx, base+"/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0", &a); err != nil {
		return "", err
	}
	addr := net.JoinHostPort(a.RankIP, strconv.FormatInt(a.RankPort, 10))
	r.mu.Lock()
	r.cache[bootstrapAddr] = cached{addr: addr, at: time.Now()}
	r.mu.Unlock()
	return addr, nil
}

func (r *Resolver) get(ctx context.Context, url string, v any) (int, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return 0, err
	}
	resp, err := r.Client.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return resp.StatusCode, fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	if err := json.NewDecoder(resp.Body).Decode(v); err != nil {
		return resp.StatusCode, fmt.Errorf("GET %s: %w", url, err)
	}
	return resp.StatusCode, nil
}
