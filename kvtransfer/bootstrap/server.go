// Package bootstrap is SGLang's prefill-side bootstrap HTTP API
// (CommonKVBootstrapServer): prefill ranks register with PUT /route, decode
// reads the topology and a rank's address with GET /route, DP ranks of rooms
// go through /register_dp_rank and /query_dp_ranks. The prefill kvproxy
// serves it on the bootstrap port and registers itself as the only rank, so
// the router's bootstrap_host/port/room need no change.
package bootstrap

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"sync"
	"time"
)

// RankInfo is the body of PUT /route (SGLang's field names).
type RankInfo struct {
	AttnTPSize               int    `json:"attn_tp_size"`
	AttnTPRank               int    `json:"attn_tp_rank"`
	AttnCPSize               int    `json:"attn_cp_size"`
	AttnCPRank               int    `json:"attn_cp_rank"`
	AttnDPSize               int    `json:"attn_dp_size"`
	AttnDPRank               int    `json:"attn_dp_rank"`
	PPSize                   int    `json:"pp_size"`
	PPRank                   int    `json:"pp_rank"`
	SystemDPSize             int    `json:"system_dp_size"`
	SystemDPRank             int    `json:"system_dp_rank"`
	RankIP                   string `json:"rank_ip"`
	RankPort                 int    `json:"rank_port"`
	PageSize                 int    `json:"page_size"`
	KVCacheDtype             string `json:"kv_cache_dtype"`
	LoadBalanceMethod        string `json:"load_balance_method"`
	EnableDSACacheLayerSplit bool   `json:"enable_dsa_cache_layer_split"`
	PrefillHTTPPort          int    `json:"prefill_http_port"`
}

// Topology is GET /route with every rank -1.
type Topology struct {
	AttnTPSize               int    `json:"attn_tp_size"`
	AttnCPSize               int    `json:"attn_cp_size"`
	DPSize                   int    `json:"dp_size"`
	PPSize                   int    `json:"pp_size"`
	PageSize                 int    `json:"page_size"`
	KVCacheDtype             string `json:"kv_cache_dtype"`
	FollowBootstrapRoom      bool   `json:"follow_bootstrap_room"`
	EnableDSACacheLayerSplit bool   `json:"enable_dsa_cache_layer_split"`
	PrefillHTTPPort          int    `json:"prefill_http_port"`
}

// RankAddr is GET /route for one rank: where its transfer engine listens.
type RankAddr struct {
	RankIP   string `json:"rank_ip"`
	RankPort int    `json:"rank_port"`
}

type rankKey struct{ dp, cp, tp, pp int }

type dpEntry struct {
	rank int
	at   time.Time
}

// Server holds the tables. The zero value is not usable; use NewServer.
type Server struct {
	// EntryTTL is how long a room's DP rank is kept (SGLang: 120 s).
	EntryTTL time.Duration

	mu    sync.Mutex
	topo  *Topology
	ranks map[rankKey]RankAddr
	dp    map[uint64]dpEntry
	now   func() time.Time
}

// NewServer returns an empty server.
func NewServer() *Server {
	return &Server{EntryTTL: 120 * time.Second, ranks: map[rankKey]RankAddr{}, dp: map[uint64]dpEntry{}, now: time.Now}
}

// Register records a prefill rank, as PUT /route does.
func (s *Server) Register(r RankInfo) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.topo == nil {
		s.topo = &Topology{}
	}
	*s.topo = Topology{
		AttnTPSize: max(r.AttnTPSize, 1), AttnCPSize: max(r.AttnCPSize, 1),
		DPSize: max(r.SystemDPSize, r.AttnDPSize, 1), PPSize: max(r.PPSize, 1),
		PageSize: r.PageSize, KVCacheDtype: r.KVCacheDtype,
		FollowBootstrapRoom:      r.LoadBalanceMethod == "follow_bootstrap_room",
		EnableDSACacheLayerSplit: r.EnableDSACacheLayerSplit, PrefillHTTPPort: r.PrefillHTTPPort,
	}
	dp := r.SystemDPRank
	if r.SystemDPSize <= 1 {
		dp = r.AttnDPRank
	}
	s.ranks[rankKey{dp, r.AttnCPRank, r.AttnTPRank, r.PPRank}] = RankAddr{RankIP: r.RankIP, RankPort: r.RankPort}
}

func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	switch {
	case r.URL.Path == "/health" && r.Method == http.MethodGet:
		_, _ = w.Write([]byte("OK"))
	case r.URL.Path == "/route" && r.Method == http.MethodPut:
		var info RankInfo
		if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, 1<<20)).Decode(&info); err != nil {
			http.Error(w, "bad rank info: "+err.Error(), http.StatusBadRequest)
			return
		}
		s.Register(info)
		_, _ = w.Write([]byte("OK"))
	case r.URL.Path == "/route" && r.Method == http.MethodGet:
		s.getRoute(w, r)
	case r.URL.Path == "/register_dp_rank" && r.Method == http.MethodPost:
		var body struct {
			Room   uint64 `json:"bootstrap_room"`
			DPRank int    `json:"dp_rank"`
		}
		if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, 1<<20)).Decode(&body); err != nil {
			http.Error(w, "bad body: "+err.Error(), http.StatusBadRequest)
			return
		}
		s.mu.Lock()
		s.expireLocked()
		s.dp[body.Room] = dpEntry{rank: body.DPRank, at: s.now()}
		s.mu.Unlock()
		_, _ = w.Write([]byte("OK"))
	case r.URL.Path == "/query_dp_ranks" && r.Method == http.MethodPost:
		var body struct {
			Rooms []uint64 `json:"bootstrap_rooms"`
		}
		if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, 1<<20)).Decode(&body); err != nil {
			http.Error(w, "bad body: "+err.Error(), http.StatusBadRequest)
			return
		}
		out := map[string]int{}
		s.mu.Lock()
		s.expireLocked()
		for _, room := range body.Rooms {
			if e, ok := s.dp[room]; ok {
				out[strconv.FormatUint(room, 10)] = e.rank
			}
		}
		s.mu.Unlock()
		writeJSON(w, out)
	default:
		http.NotFound(w, r)
	}
}

func (s *Server) expireLocked() {
	now := s.now()
	for room, e := range s.dp {
		if now.Sub(e.at) > s.EntryTTL {
			delete(s.dp, room)
		}
	}
}

func (s *Server) getRoute(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	var k [4]int
	for i, name := range []string{"prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank"} {
		v := q.Get(name)
		if v == "" && name == "prefill_cp_rank" {
			// Older SGLang sends no cp rank: -1 in the topology form, else 0.
			v = "0"
			if q.Get("prefill_dp_rank") == "-1" {
				v = "-1"
			}
		}
		n, err := strconv.Atoi(v)
		if err != nil {
			http.Error(w, fmt.Sprintf("bad %s %q", name, v), http.StatusBadRequest)
			return
		}
		k[i] = n
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if k == [4]int{-1, -1, -1, -1} {
		t := s.topo
		if t == nil || len(s.ranks) < t.DPSize*t.AttnCPSize*t.AttnTPSize*t.PPSize {
			http.Error(w, "prefill ranks not all registered yet", http.StatusServiceUnavailable)
			return
		}
		writeJSON(w, t)
		return
	}
	a, ok := s.ranks[rankKey{k[0], k[1], k[2], k[3]}]
	if !ok {
		http.Error(w, "unknown rank", http.StatusNotFound)
		return
	}
	writeJSON(w, a)
}

func writeJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(v)
}
