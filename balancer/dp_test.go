package balancer

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/pdrouter/pdrouter/mock/mockworker"
)

func startMock(t *testing.T, cfg mockworker.Config) *mockworker.Server {
	t.Helper()
	s, err := mockworker.Start(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

// register adds url to m and waits for its registration.
func register(t *testing.T, m *Manager, spec WorkerSpec) string {
	t.Helper()
	id, err := m.Add(spec)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := m.Await(ctx, id); err != nil {
		t.Fatalf("registering %s: %v", spec.URL, err)
	}
	return id
}

func rankURLs(ws []*Worker) []string {
	var out []string
	for _, w := range ws {
		out = append(out, w.URL)
	}
	return out
}

func TestDPAwareRegistersOneWorkerPerRank(t *testing.T) {
	e := startMock(t, mockworker.Config{Engine: mockworker.EngineInfo{DPSize: 4}, Model: "dp-model"})
	m := newTestManager(t, ManagerConfig{DPAware: true})
	id := register(t, m, WorkerSpec{URL: e.URL(), WorkerType: "decode"})
	ws := m.Snapshot().ByBaseURL(e.URL())
	want := []string{e.URL() + "@0", e.URL() + "@1", e.URL() + "@2", e.URL() + "@3"}
	if fmt.Sprint(rankURLs(ws)) != fmt.Sprint(want) || len(m.Snapshot().ByType[Decode]) != 4 {
		t.Fatalf("workers %v, want %v", rankURLs(m.Snapshot().All), want)
	}
	ids := map[string]bool{}
	for i, w := range ws {
		if w.DPRank != i || w.DPSize != 4 || w.BaseURL != e.URL() || w.ModelID != "dp-model" || w.Type != Decode {
			t.Errorf("rank %d: %+v", i, w)
		}
		if w.BootstrapHost != "127.0.0.1" {
			t.Errorf("rank %d bootstrap host %q", i, w.BootstrapHost)
		}
		ids[w.ID] = true
		info := w.Info()
		if info.URL != want[i] || info.DPBaseURL != e.URL() || info.DPRank == nil || *info.DPRank != i || info.DPSize != 4 {
			t.Errorf("rank %d info %+v", i, info)
		}
	}
	if len(ids) != 4 || ws[0].ID != id {
		t.Errorf("ids %v: want 4 distinct, rank 0's the job's %s", ids, id)
	}
	// The engine's base URL names all its ranks: Get finds the first,
	// Add refuses it again, Update and Remove apply to every rank.
	if wi, ok := m.Get(e.URL()); !ok || wi.URL != want[0] {
		t.Errorf("Get(base) = %+v, %v", wi, ok)
	}
	if _, err := m.Add(WorkerSpec{URL: e.URL(), WorkerType: "decode"}); err == nil {
		t.Error("re-adding a registered engine succeeded")
	}
	prio := uint32(7)
	if _, err := m.Update(e.URL(), WorkerUpdate{Priority: &prio}); err != nil {
		t.Fatal(err)
	}
	for _, w := range m.Snapshot().All {
		if w.Priority != 7 {
			t.Errorf("%s priority %d after updating the base URL", w.URL, w.Priority)
		}
	}
	if _, ok := m.Remove(want[2]); !ok || len(m.Snapshot().All) != 3 {
		t.Fatalf("removing one rank left %v", rankURLs(m.Snapshot().All))
	}
	if _, ok := m.Remove(e.URL()); !ok || len(m.Snapshot().All) != 0 {
		t.Fatalf("removing the engine left %v", rankURLs(m.Snapshot().All))
	}
}

// The id a --dp-aware registration returns names the engine: DELETE by it
// removes every rank, not rank 0 alone.
func TestDPAwareRemoveByReturnedID(t *testing.T) {
	e := startMock(t, mockworker.Config{Engine: mockworker.EngineInfo{DPSize: 4}})
	m := newTestManager(t, ManagerConfig{DPAware: true})
	id := register(t, m, WorkerSpec{URL: e.URL(), WorkerType: "decode"})
	if wi, ok := m.Remove(id); !ok || wi.ID != id || len(m.Snapshot().All) != 0 {
		t.Fatalf("removing by the returned id left %v", rankURLs(m.Snapshot().All))
	}
}

func TestDPAwareDiscovery(t *testing.T) {
	cases := []struct {
		name  string
		cfg   mockworker.Config
		ranks int
	}{
		{"server_info", mockworker.Config{Engine: mockworker.EngineInfo{DPSize: 3}}, 3},
		{"get_server_info fallback", mockworker.Config{Engine: mockworker.EngineInfo{DPSize: 2}, NoServerInfo: true}, 2},
		{"no dp_size is one rank", mockworker.Config{Engine: mockworker.EngineInfo{DPSize: 8}, NoDPSize: true}, 1},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			e := startMock(t, c.cfg)
			m := newTestManager(t, ManagerConfig{DPAware: true})
			register(t, m, WorkerSpec{URL: e.URL()})
			ws := m.Snapshot().All
			if len(ws) != c.ranks {
				t.Fatalf("%d workers %v, want %d", len(ws), rankURLs(ws), c.ranks)
			}
			for i, w := range ws {
				if w.URL != fmt.Sprintf("%s@%d", e.URL(), i) || w.DPSize != c.ranks {
					t.Errorf("worker %d: %s size %d", i, w.URL, w.DPSize)
				}
			}
		})
	}
	// Without --dp-aware an engine of 4 ranks is one worker, as before.
	e := startMock(t, mockworker.Config{Engine: mockworker.EngineInfo{DPSize: 4}})
	m := newTestManager(t, ManagerConfig{})
	register(t, m, WorkerSpec{URL: e.URL()})
	if ws := m.Snapshot().All; len(ws) != 1 || ws[0].URL != e.URL() || ws[0].DPSize != 0 || ws[0].Info().DPRank != nil {
		t.Fatalf("workers %+v", ws)
	}
}

func TestDPAwareRejectsBadDPSize(t *testing.T) {
	for _, dp := range []any{0, -2, 1.5, "4", 5000} {
		e := newFakeEngine(t, 200)
		e.serverInfo = map[string]any{"served_model_name": "m", "dp_size": dp}
		m := newTestManager(t, ManagerConfig{DPAware: true})
		id, _ := m.Add(WorkerSpec{URL: e.URL})
		err := m.Await(context.Background(), id)
		if err == nil || !strings.Contains(err.Error(), "dp_size") || len(m.Snapshot().All) != 0 {
			t.Errorf("dp_size %v: err %v, workers %d", dp, err, len(m.Snapshot().All))
		}
		if wi, _ := m.Get(id); wi.JobStatus == nil || wi.JobStatus.Status != JobFailed {
			t.Errorf("dp_size %v: job %+v", dp, wi.JobStatus)
		}
	}
}

// An engine whose info cannot be read fails a dp-aware registration
// rather than being guessed one rank.
func TestDPAwareUnreadableInfoFails(t *testing.T) {
	e := newFakeEngine(t, 200)
	e.serverInfo = nil
	mux := http.NewServeMux()
	mux.HandleFunc("/health", func(http.ResponseWriter, *http.Request) {})
	mux.HandleFunc("/server_info", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("not json")) })
	e.Config.Handler = mux
	m := newTestManager(t, ManagerConfig{DPAware: true})
	id, _ := m.Add(WorkerSpec{URL: e.URL})
	if err := m.Await(context.Background(), id); err == nil || !strings.Contains(err.Error(), "--dp-aware") {
		t.Errorf("err %v", err)
	}
}

// Each rank has its own health and breaker: probes go to the engine's base
// URL (so every rank stays healthy), and failures on one rank shut out that
// rank only.
func TestDPRanksHealthAndBreakerIndependent(t *testing.T) {
	e := startMock(t, mockworker.Config{Engine: mockworker.EngineInfo{DPSize: 2}})
	cfg := ManagerConfig{DPAware: true, StartupInterval: 20 * time.Millisecond,
		Breaker: BreakerConfig{FailureThreshold: 2, SuccessThreshold: 1, OpenDuration: time.Hour}}
	cfg.Health = HealthConfig{Interval: 10 * time.Millisecond, Timeout: time.Second, FailureThreshold: 1, SuccessThreshold: 1}
	m := NewManager(cfg)
	t.Cleanup(m.Stop)
	if err := m.Start(); err != nil {
		t.Fatal(err)
	}
	register(t, m, WorkerSpec{URL: e.URL()})
	ws := m.Snapshot().All
	time.Sleep(100 * time.Millisecond) // several probe rounds
	for _, w := range ws {
		if !w.Healthy() {
			t.Fatalf("%s unhealthy: probes must go to the base URL", w.URL)
		}
	}
	ws[1].Record(false)
	ws[1].Record(false)
	if ws[1].Available() || !ws[0].Available() {
		t.Errorf("breaker: rank 1 available %v, rank 0 available %v", ws[1].Available(), ws[0].Available())
	}
	if got := m.Snapshot().Available(Regular); len(got) != 1 || got[0] != ws[0] {
		t.Errorf("available %v", rankURLs(got))
	}
	ws[0].SetHealthy(false)
	if ws[1].Healthy() != true || ws[0].Healthy() {
		t.Error("health shared between ranks")
	}
}

// A rank's load is that rank's, from /v1/loads?dp_rank= or /get_load.
func TestDPRankLoads(t *testing.T) {
	for _, legacy := range []bool{false, true} {
		e := startMock(t, mockworker.Config{Engine: mockworker.EngineInfo{DPSize: 2}, NoV1Loads: legacy, PrefillDelay: time.Hour})
		m := newTestManager(t, ManagerConfig{DPAware: true})
		register(t, m, WorkerSpec{URL: e.URL()})
		ws := m.Snapshot().All
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() {
			defer close(done)
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, e.URL()+"/generate",
				strings.NewReader(`{"text":"a b c","sampling_params":{"max_new_tokens":2},"routed_dp_rank":1}`))
			if resp, err := http.DefaultClient.Do(req); err == nil {
				resp.Body.Close()
			}
		}()
		waitFor(t, "request on rank 1", func() bool { return e.Stats().RankRequests[1] == 1 })
		for i, want := range []int64{0, 5} {
			if n, err := FetchLoad(context.Background(), m.client, ws[i], time.Second); err != nil || n != want {
				t.Errorf("legacy %v rank %d: load %d, %v; want %d", legacy, i, n, err, want)
			}
		}
		st := e.Stats()
		if legacy && st.GetLoadPolls == 0 || !legacy && st.V1LoadPolls == 0 {
			t.Errorf("legacy %v: polls %+v", legacy, st)
		}
		cancel()
		<-done
		http.DefaultClient.CloseIdleConnections()
	}
}

func TestParseLoadsByRank(t *testing.T) {
	v1 := `{"loads":[{"dp_rank":0,"num_total_tokens":3},{"dp_rank":1,"num_total_tokens":5},{"num_used_tokens":1}]}`
	for rank, want := range map[int]int64{-1: 9, 0: 4, 1: 6, 2: 1} {
		if n, err := parseLoads([]byte(v1), rank); err != nil || n != want {
			t.Errorf("parseLoads rank %d = %d, %v; want %d", rank, n, err, want)
		}
	}
	legacy := `[{"dp_rank":0,"num_tokens":2},{"dp_rank":1,"num_tokens":7}]`
	for rank, want := range map[int]int64{-1: 9, 0: 2, 1: 7, 3: 0} {
		if n, err := parseLoad([]byte(legacy), rank); err != nil || n != want {
			t.Errorf("parseLoad rank %d = %d, %v; want %d", rank, n, err, want)
		}
	}
}

// FuzzParseServerInfo: /server_info is untrusted input. Any bytes give a
// dp_size in 0..maxDPSize (0: not reported) or an error, never a panic.
func FuzzParseServerInfo(f *testing.F) {
	for _, s := range []string{`{"dp_size":4,"served_model_name":"m"}`, `{"dp_size":null}`, `{"dp_size":1e9}`,
		`{"dp_size":-1}`, `{"dp_size":2.5}`, `{"served_model_name":["a","b"],"model_path":"p"}`, `[]`, `{"dp_size":"8"}`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		info, err := parseServerInfo(body)
		if err == nil && (info.dpSize < 0 || info.dpSize > maxDPSize) {
			t.Fatalf("dp_size %d accepted from %s", info.dpSize, body)
		}
	})
}

func TestParseServerInfoEnableHTTP2(t *testing.T) {
	for body, want := range map[string]bool{
		`{"enable_http2":true}`: true, `{"enable_http2":false}`: false, `{}`: false,
		`{"enable_http2":"true"}`: false, `{"enable_http2":1,"served_model_name":"m"}`: false,
	} {
		info, err := parseServerInfo([]byte(body))
		if err != nil || info.http2 != want {
			t.Errorf("%s: http2 %v, %v; want %v", body, info.http2, err, want)
		}
	}
}
