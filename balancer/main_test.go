package balancer

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// fakeEngine is an SGLang-shaped worker whose health can be flipped.
type fakeEngine struct {
	*httptest.Server
	healthStatus atomic.Int32 // status /health answers
	probes       atomic.Int32
	load         atomic.Int64 // num_tokens reported by /get_load
	serverInfo   map[string]any
	oldInfoOnly  bool // 404 on /server_info, like SGLang before 2026
}

func newFakeEngine(t *testing.T, status int) *fakeEngine {
	e := &fakeEngine{serverInfo: map[string]any{"served_model_name": "mock-model", "model_path": "/models/mock"}}
	e.healthStatus.Store(int32(status))
	mux := http.NewServeMux()
	mux.HandleFunc("/health", func(w http.ResponseWriter, _ *http.Request) {
		e.probes.Add(1)
		w.WriteHeader(int(e.healthStatus.Load()))
	})
	info := func(w http.ResponseWriter, _ *http.Request) { json.NewEncoder(w).Encode(e.serverInfo) }
	mux.HandleFunc("/get_server_info", info)
	mux.HandleFunc("/server_info", func(w http.ResponseWriter, r *http.Request) {
		if e.oldInfoOnly {
			http.NotFound(w, r)
			return
		}
		info(w, r)
	})
	mux.HandleFunc("/get_load", func(w http.ResponseWriter, _ *http.Request) {
		n := e.load.Load()
		json.NewEncoder(w).Encode([]map[string]int64{{"num_tokens": n / 2, "dp_rank": 0}, {"num_tokens": n - n/2, "dp_rank": 1}})
	})
	e.Server = httptest.NewServer(mux)
	t.Cleanup(e.Close)
	return e
}
