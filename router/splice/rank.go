package splice

import "strconv"

// The DP rank fields SGLang reads from a request body (io_struct.py
// GenerateReqInput and the OpenAI protocol's requests), indexes of Ranks:
//
//   - data_parallel_rank: the rank that runs the request; deprecated for
//     routed_dp_rank, which wins when both are set. sglang-router 0.3.x
//     sends it in regular mode with --dp-aware.
//   - routed_dp_rank: the same, current spelling. smg sends it on both PD
//     legs: prefill's rank to prefill, decode's to decode.
//   - disagg_prefill_dp_rank: on the decode leg, the prefill rank that
//     holds the request's KV (smg pd_router.rs).
const (
	DataParallelRank = iota
	RoutedDPRank
	DisaggPrefillDPRank
)

var rankKeys = [3]string{"data_parallel_rank", "routed_dp_rank", "disagg_prefill_dp_rank"}

// Ranks are the values of the client's own DP rank fields in its body,
// indexed by DataParallelRank, RoutedDPRank and DisaggPrefillDPRank.
type Ranks [3]Span

// FindRanks locates the client's rank fields in body, which Inspect
// validated into info. Only requests that carry one (info.HasRanks, rare)
// pay for the pass over the body: Info itself keeps no spans for them, so
// that requests without --dp-aware do not grow.
func FindRanks(body []byte, info *Info) Ranks {
	var r Ranks
	if !info.HasRanks {
		return r
	}
	s := scanner{b: body}
	s.skipWS()
	if s.i >= len(s.b) || s.b[s.i] != '{' {
		return r
	}
	s.i++
	s.skipWS()
	for s.i < len(s.b) && s.b[s.i] == '"' {
		keyStart := s.i
		if s.str() != nil {
			return r
		}
		key := s.b[keyStart+1 : s.i-1]
		s.skipWS()
		s.i++ // ':'
		s.skipWS()
		valStart := s.i
		if s.value(1) != nil {
			return r
		}
		for k, name := range rankKeys {
			if bstr(key) == name {
				r[k] = Span{int32(valStart), int32(s.i)}
			}
		}
		if done, err := s.next('}'); done || err != nil {
			return r
		}
		s.skipWS()
	}
	return r
}

// SetRank sets the rank field to rank (an integer, as SGLang's
// Optional[int]), in place of the client's value at at[field] if it sent
// one.
func SetRank(b *Body, at *Ranks, field, rank int) {
	var v [20]byte
	b.Set(rankKeys[field], at[field], strconv.AppendInt(v[:0], int64(rank), 10))
}
