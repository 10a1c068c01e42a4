package mockworker

import (
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"time"
)

// loadPolls counts the load endpoints' calls, so tests can tell which one
// a router reads.
type loadPolls struct{ v1, legacy atomic.Int64 }

// v1LoadSections are the include= sections SGLang accepts (GetLoadsReqInput).
var v1LoadSections = map[string]bool{"core": true, "memory": true, "spec": true, "lora": true, "disagg": true, "queues": true, "all": true}

// v1Loads serves SGLang's GET /v1/loads (one entry per DP rank, the core
// section):
// dp_rank= selects a rank (400 for one the engine lacks), include= is
// validated as SGLang does. With Config.NoV1Loads it is a 404, as on an
// engine older than the endpoint.
func (s *Server) v1Loads(w http.ResponseWriter, r *http.Request) {
	if s.cfg.NoV1Loads {
		http.NotFound(w, r)
		return
	}
	s.polls.v1.Add(1)
	q := r.URL.Query()
	if inc := q.Get("include"); inc != "" {
		for sec := range strings.SplitSeq(inc, ",") {
			if !v1LoadSections[strings.TrimSpace(sec)] {
				_ = writeError(w, badRequest("Invalid include sections: %q", sec))
				return
			}
		}
	}
	ranks := s.rec.rankLoads()
	first, last := 0, len(ranks)
	if rank := q.Get("dp_rank"); rank != "" {
		n, err := strconv.Atoi(rank)
		if err != nil || n < 0 || n >= len(ranks) {
			_ = writeError(w, badRequest("invalid dp_rank %q: the engine has dp_size %d", rank, len(ranks)))
			return
		}
		first, last = n, n+1
	}
	st, tokens, _, _ := s.rec.snapshot()
	loads := []any{}
	for i := first; i < last; i++ {
		rl := ranks[i]
		loads = append(loads, map[string]any{
			"dp_rank": i, "num_running_reqs": rl.reqs, "num_waiting_reqs": 0, "num_total_reqs": rl.reqs,
			"num_used_tokens": rl.tokens, "num_total_tokens": rl.tokens, "max_total_num_tokens": mockTokenCapacity,
			"token_usage": float64(rl.tokens) / mockTokenCapacity, "gen_throughput": 0.0, "cache_hit_rate": 0.0,
			"utilization": float64(rl.tokens) / mockTokenCapacity, "max_running_requests": 1024,
		})
	}
	s.writeAny(w, map[string]any{
		"timestamp": time.Now().UTC().Format(time.RFC3339Nano), "version": "mock", "dp_rank_count": len(loads),
		"loads": loads,
		"aggregate": map[string]any{"total_running_reqs": st.InFlight, "total_waiting_reqs": 0, "total_reqs": st.InFlight,
			"avg_token_usage": float64(tokens) / mockTokenCapacity, "avg_throughput": 0.0, "avg_utilization": float64(tokens) / mockTokenCapacity},
	})
}

// mockTokenCapacity is the KV capacity the mock claims, in tokens.
const mockTokenCapacity = 1 << 20
