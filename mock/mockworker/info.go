package mockworker

import (
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"time"
)

// Health, info and introspection endpoints.

// healthy applies --health-fail-after and --health-flap.
func (s *Server) healthy() bool {
	up := time.Since(s.started)
	if s.cfg.HealthFailAfter > 0 && up >= s.cfg.HealthFailAfter {
		return false
	}
	return s.cfg.HealthFlap <= 0 || (up/s.cfg.HealthFlap)%2 == 0
}

// health serves /health and /health_generate: SGLang answers 200 with an
// empty body.
func (s *Server) health(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("X-Worker-Id", s.workerID)
	if !s.healthy() {
		w.WriteHeader(http.StatusServiceUnavailable)
		return
	}
	w.WriteHeader(http.StatusOK)
}

func (s *Server) writeAny(w http.ResponseWriter, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		_ = writeError(w, errorf(http.StatusInternalServerError, "%v", err))
		return
	}
	_ = writeJSONBytes(w, http.StatusOK, b)
}

func (s *Server) models(w http.ResponseWriter, _ *http.Request) {
	s.writeAny(w, map[string]any{"object": "list", "data": []map[string]any{{
		"id": s.cfg.Model, "object": "model", "created": s.started.Unix(), "owned_by": "sglang", "root": s.cfg.Model,
	}}})
}

func (s *Server) modelInfo(w http.ResponseWriter, _ *http.Request) {
	s.writeAny(w, map[string]any{"model_path": s.cfg.Model, "tokenizer_path": s.cfg.Model, "is_generation": true,
		"preferred_sampling_params": nil, "weight_version": "default"})
}

func (s *Server) disaggregationMode() string {
	if s.cfg.Role == RoleRegular {
		return "null" // SGLang's own spelling for "not disaggregated"
	}
	return string(s.cfg.Role)
}

// newServerInfo is /server_info, which SGLang added after /get_server_info:
// Config.NoServerInfo plays an engine older than it (404).
func (s *Server) newServerInfo(w http.ResponseWriter, r *http.Request) {
	if s.cfg.NoServerInfo {
		http.NotFound(w, r)
		return
	}
	s.serverInfo(w, r)
}

func (s *Server) serverInfo(w http.ResponseWriter, _ *http.Request) {
	st, tokens, _, _ := s.rec.snapshot()
	info := map[string]any{
		"served_model_name":               s.cfg.Model,
		"model_path":                      s.cfg.Model,
		"tokenizer_path":                  s.cfg.Model,
		"disaggregation_mode":             s.disaggregationMode(),
		"disaggregation_bootstrap_port":   s.cfg.BootstrapPort,
		"dp_size":                         s.cfg.Engine.DPSize,
		"tp_size":                         s.cfg.Engine.TPSize,
		"page_size":                       s.cfg.Engine.PageSize,
		"kv_cache_dtype":                  s.cfg.Engine.KVCacheDtype,
		"disaggregation_transfer_backend": s.cfg.Engine.TransferBackend,
		"enable_http2":                    s.cfg.HTTP2,
		"host":                            s.cfg.Host,
		"port":                            s.ln.Addr().(*net.TCPAddr).Port,
		"worker_id":                       s.workerID,
		"version":                         "mock",
		"internal_states":                 []map[string]any{{"num_running_reqs": st.InFlight, "num_used_tokens": tokens}},
	}
	if s.cfg.NoDPSize {
		delete(info, "dp_size")
	}
	s.writeAny(w, info)
}

// load serves SGLang's /get_load: one entry per DP rank.
func (s *Server) load(w http.ResponseWriter, _ *http.Request) {
	s.polls.legacy.Add(1)
	ranks := s.rec.rankLoads()
	out := make([]map[string]int64, len(ranks))
	for i, rl := range ranks {
		out[i] = map[string]int64{"dp_rank": int64(i), "num_reqs": rl.reqs, "num_waiting_reqs": 0, "num_tokens": rl.tokens}
	}
	s.writeAny(w, out)
}

func (s *Server) flushCache(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodGet && r.Method != http.MethodPost {
		w.Header().Set("Allow", "GET, POST")
		http.Error(w, "method not allowed", http.StatusMethodNotAllowed)
		return
	}
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	_, _ = w.Write([]byte("Cache flushed.\n"))
}

// metrics serves a few of SGLang's Prometheus series.
func (s *Server) metrics(w http.ResponseWriter, _ *http.Request) {
	st, tokens, prompt, gen := s.rec.snapshot()
	labels := `{model_name=` + strconv.Quote(s.cfg.Model) + `}`
	w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
	for _, m := range []struct {
		name, typ, help string
		v               int64
	}{
		{"num_running_reqs", "gauge", "The number of running requests.", st.InFlight},
		{"num_queue_reqs", "gauge", "The number of requests in the waiting queue.", 0},
		{"num_used_tokens", "gauge", "The number of used tokens.", tokens},
		{"prompt_tokens_total", "counter", "Number of prefill tokens processed.", prompt},
		{"generation_tokens_total", "counter", "Number of generation tokens processed.", gen},
	} {
		fmt.Fprintf(w, "# HELP sglang:%s %s\n# TYPE sglang:%s %s\nsglang:%s%s %d\n", m.name, m.help, m.name, m.typ, m.name, labels, m.v)
	}
}

func (s *Server) mockRequests(w http.ResponseWriter, _ *http.Request) { s.writeAny(w, s.Requests()) }

func (s *Server) mockStats(w http.ResponseWriter, _ *http.Request) { s.writeAny(w, s.Stats()) }

func (s *Server) mockReset(w http.ResponseWriter, _ *http.Request) {
	s.Reset()
	w.WriteHeader(http.StatusNoContent)
}
