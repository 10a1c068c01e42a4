package mockworker

import (
	"encoding/json"
	"net/http"
	"strings"
	"sync"
	"time"
)

// Outcomes of a generation request, as reported in RecordedRequest.Finished.
const (
	FinishedOK         = "ok"
	FinishedError      = "error"       // answered with a non-2xx status
	FinishedClientGone = "client_gone" // the client disconnected before the response finished
)

// RecordedRequest is one generation request as the mock received it.
type RecordedRequest struct {
	Path    string            `json:"path"`
	Method  string            `json:"method"`
	Headers map[string]string `json:"headers"` // lower-case names; repeated values joined with ", "
	Body    string            `json:"body"`
	// The bootstrap fields exactly as received (raw JSON); absent keys are omitted.
	BootstrapHost json.RawMessage `json:"bootstrap_host,omitempty"`
	BootstrapPort json.RawMessage `json:"bootstrap_port,omitempty"`
	BootstrapRoom json.RawMessage `json:"bootstrap_room,omitempty"`
	// The DP rank fields exactly as received (raw JSON), and the rank the
	// request ran on (routed_dp_rank, else data_parallel_rank, else 0).
	RoutedDPRank        json.RawMessage `json:"routed_dp_rank,omitempty"`
	DataParallelRank    json.RawMessage `json:"data_parallel_rank,omitempty"`
	DisaggPrefillDPRank json.RawMessage `json:"disagg_prefill_dp_rank,omitempty"`
	DPRank              int             `json:"dp_rank"`
	Status              int             `json:"status,omitempty"` // 0 until answered
	StartedUnixNano     int64           `json:"started_unix_nano"`
	Finished            string          `json:"finished,omitempty"` // "" while in flight
	FinishedUnixNano    int64           `json:"finished_unix_nano,omitempty"`
	// Proto is HTTP/1.1 or HTTP/2.0; Remote the client's host:port, one
	// per connection.
	Proto  string `json:"proto"`
	Remote string `json:"remote_addr"`
}

// Stats counts generation requests since start or the last Reset.
// InFlight is always the live count; Reset does not clear it.
type Stats struct {
	Requests   int64 `json:"requests"`
	InFlight   int64 `json:"in_flight"`
	ClientGone int64 `json:"client_gone"`
	Completed  int64 `json:"completed"`
	Errors     int64 `json:"errors"`
	// Calls of GET /v1/loads and of the deprecated GET /get_load (not reset).
	V1LoadPolls  int64 `json:"v1_load_polls"`
	GetLoadPolls int64 `json:"get_load_polls"`
	// RankRequests counts the requests each DP rank ran (index = rank).
	RankRequests []int64 `json:"rank_requests"`
}

// recorder keeps a ring of the last records and the counters. One mutex is
// plenty: it is taken three times per request, never across I/O.
type recorder struct {
	mu             sync.Mutex
	limit          int
	ring           []*RecordedRequest
	next           int // ring slot to overwrite once full
	stats          Stats
	inFlightTokens int64      // for /get_load and /metrics
	ranks          []rankLoad // in flight per DP rank, for the load endpoints
	promptTokens   int64      // totals for /metrics, not reset
	genTokens      int64
}

func newRecorder(limit, dpSize int) *recorder {
	return &recorder{limit: max(limit, 0), ranks: make([]rankLoad, dpSize),
		stats: Stats{RankRequests: make([]int64, dpSize)}}
}

func (rc *recorder) start(r *http.Request) *RecordedRequest {
	rec := &RecordedRequest{
		Path:            r.URL.Path,
		Method:          r.Method,
		Proto:           r.Proto,
		Remote:          r.RemoteAddr,
		Headers:         make(map[string]string, len(r.Header)+1),
		StartedUnixNano: time.Now().UnixNano(),
	}
	for k, v := range r.Header {
		rec.Headers[strings.ToLower(k)] = strings.Join(v, ", ")
	}
	rec.Headers["host"] = r.Host
	rc.mu.Lock()
	defer rc.mu.Unlock()
	rc.stats.Requests++
	rc.stats.InFlight++
	if rc.limit == 0 {
		return rec
	}
	if len(rc.ring) < rc.limit {
		rc.ring = append(rc.ring, rec)
	} else {
		rc.ring[rc.next] = rec
		rc.next = (rc.next + 1) % rc.limit
	}
	return rec
}

// setBody records what was read and parsed, as soon as it is known, so tests
// can see a hanging request's body.
func (rc *recorder) setBody(rec *RecordedRequest, body []byte, req *request) {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	rec.Body = string(body)
	if req != nil {
		rec.BootstrapHost, rec.BootstrapPort, rec.BootstrapRoom = req.bootHost, req.bootPort, req.bootRoom
		rec.RoutedDPRank, rec.DataParallelRank, rec.DisaggPrefillDPRank = req.routedRank, req.legacyRank, req.prefillRankJSON
		rec.DPRank = req.ranks.rank
	}
}

// begin adds a request's in-flight tokens on its DP rank; end removes them.
func (rc *recorder) begin(rank int, tokens int64) {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	rc.inFlightTokens += tokens
	rc.ranks[rank].tokens += tokens
	rc.ranks[rank].reqs++
	rc.stats.RankRequests[rank]++
}

func (rc *recorder) end(rank int, tokens int64) {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	rc.inFlightTokens -= tokens
	rc.ranks[rank].tokens -= tokens
	rc.ranks[rank].reqs--
}

// rankLoads copies the per-rank loads. Requests not parsed yet (or parked
// by Hang) count on rank 0, where a request naming no rank runs.
func (rc *recorder) rankLoads() []rankLoad {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	out := append([]rankLoad(nil), rc.ranks...)
	out[0].reqs = rc.stats.InFlight
	for _, rl := range out[1:] {
		out[0].reqs -= rl.reqs
	}
	return out
}

func (rc *recorder) finish(rec *RecordedRequest, status int, outcome string, promptTokens, genTokens int64) {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	rec.Status = status
	rec.Finished = outcome
	rec.FinishedUnixNano = time.Now().UnixNano()
	rc.stats.InFlight--
	rc.promptTokens += promptTokens
	rc.genTokens += genTokens
	switch outcome {
	case FinishedOK:
		rc.stats.Completed++
	case FinishedClientGone:
		rc.stats.ClientGone++
	default:
		rc.stats.Errors++
	}
}

func (rc *recorder) requests() []RecordedRequest {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	out := make([]RecordedRequest, 0, len(rc.ring))
	for i := range rc.ring {
		out = append(out, *rc.ring[(rc.next+i)%len(rc.ring)])
	}
	return out
}

func (rc *recorder) snapshot() (s Stats, inFlightTokens, promptTokens, genTokens int64) {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	s = rc.stats
	s.RankRequests = append([]int64(nil), s.RankRequests...)
	return s, rc.inFlightTokens, rc.promptTokens, rc.genTokens
}

func (rc *recorder) reset() {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	rc.ring, rc.next = nil, 0
	rc.stats = Stats{InFlight: rc.stats.InFlight, RankRequests: make([]int64, len(rc.ranks))}
}
