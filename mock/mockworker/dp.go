package mockworker

import (
	"encoding/json"
	"strconv"
)

// Data-parallel ranks. An engine with dp_size N serves N ranks behind one
// port; a router picks one per request with SGLang's body fields:
// routed_dp_rank (and the deprecated data_parallel_rank, used when
// routed_dp_rank is absent) say which rank runs the request, and
// disagg_prefill_dp_rank tells a decode server which prefill rank holds the
// KV (sgl-project/sglang io_struct.py, tokenizer_manager.py
// _resolve_routed_dp_rank).

// dpRanks is what a request asked of the ranks; rank is where it runs.
type dpRanks struct {
	routed, legacy, prefill *int
	rank                    int
}

// parseRanks validates the rank fields as SGLang does: integers, the
// routed rank (or its deprecated spelling) in [0, dpSize); otherwise 400.
// Absent or null fields leave the request to rank 0.
func parseRanks(raw *rawBody, dpSize int) (dpRanks, *apiError) {
	var r dpRanks
	for _, f := range []struct {
		name string
		val  json.RawMessage
		dst  **int
	}{{"routed_dp_rank", raw.RoutedDPRank, &r.routed}, {"data_parallel_rank", raw.DataParallelRank, &r.legacy},
		{"disagg_prefill_dp_rank", raw.DisaggPrefillDPRank, &r.prefill}} {
		if isNull(f.val) {
			continue
		}
		n, err := strconv.Atoi(string(f.val))
		if err != nil {
			return r, badRequest("%s: want an integer, got %s", f.name, f.val)
		}
		*f.dst = &n
	}
	chosen, name := r.routed, "routed_dp_rank"
	if chosen == nil {
		chosen, name = r.legacy, "data_parallel_rank"
	}
	if chosen != nil {
		if *chosen < 0 || *chosen >= dpSize {
			return r, badRequest("%s=%d out of range [0, %d)", name, *chosen, dpSize)
		}
		r.rank = *chosen
	}
	if r.prefill != nil && *r.prefill < 0 {
		return r, badRequest("disagg_prefill_dp_rank=%d must not be negative", *r.prefill)
	}
	return r, nil
}

// maxDPSize bounds the ranks a mock engine keeps counters for.
const maxDPSize = 1024

// rankLoad is one rank's work in flight.
type rankLoad struct{ reqs, tokens int64 }
