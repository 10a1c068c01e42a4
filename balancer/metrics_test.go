package balancer

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

func TestMetricsSeries(t *testing.T) {
	pr := prometheus.NewRegistry()
	met, err := NewMetrics(pr)
	if err != nil {
		t.Fatal(err)
	}
	e := newFakeEngine(t, 200)
	m := NewManager(ManagerConfig{Metrics: met, StartupInterval: 10 * time.Millisecond,
		Breaker: BreakerConfig{FailureThreshold: 1, SuccessThreshold: 1, OpenDuration: time.Hour},
		Health:  HealthConfig{Interval: time.Hour}})
	defer m.Stop()
	id, _ := m.Add(WorkerSpec{URL: e.URL, WorkerType: "decode"})
	if err := m.Await(context.Background(), id); err != nil {
		t.Fatal(err)
	}
	if err := m.Start(); err != nil {
		t.Fatal(err)
	}
	w := m.Snapshot().ByID(id)
	w.IncLoad()
	w.Record(false) // opens: threshold 1
	met.Selected(w, "random")
	met.WorkerError(w, "status_5xx")
	met.Retry(Decode, "chat", 1, 50*time.Millisecond)
	met.RetriesExhausted(Decode, "chat")
	waitFor(t, "a health check", func() bool {
		_, ok := gauge(t, pr, "smg_worker_health_checks_total", map[string]string{"result": "success", "worker_type": "decode"})
		return ok
	})

	u := e.URL
	want := []struct {
		name   string
		labels map[string]string
		value  float64
	}{
		{"smg_worker_pool_size", map[string]string{"connection_mode": "http", "model": "mock-model", "worker_type": "decode"}, 1},
		{"smg_worker_requests_active", map[string]string{"worker": u}, 1},
		{"smg_worker_health", map[string]string{"worker": u}, 1},
		{"smg_worker_cb_state", map[string]string{"worker": u}, 1},
		{"smg_worker_cb_transitions_total", map[string]string{"from": "closed", "to": "open", "worker": u}, 1},
		{"smg_worker_cb_outcomes_total", map[string]string{"outcome": "failure", "worker": u}, 1},
		{"smg_worker_selection_total", map[string]string{"connection_mode": "http", "model": "mock-model", "policy": "random", "worker_type": "decode"}, 1},
		{"smg_worker_errors_total", map[string]string{"connection_mode": "http", "error_type": "status_5xx", "worker_type": "decode"}, 1},
		{"smg_worker_retries_total", map[string]string{"endpoint": "chat", "worker_type": "decode"}, 1},
		{"smg_worker_retries_exhausted_total", map[string]string{"endpoint": "chat", "worker_type": "decode"}, 1},
		{"smg_worker_health_checks_total", map[string]string{"result": "success", "worker_type": "decode"}, 1},
		{"smg_worker_cb_consecutive_failures", map[string]string{"worker": u}, 0},
		{"smg_worker_cb_consecutive_successes", map[string]string{"worker": u}, 0},
	}
	for _, c := range want {
		if got, ok := gauge(t, pr, c.name, c.labels); !ok || got != c.value {
			t.Errorf("%s%v = %v (found %v), want %v", c.name, c.labels, got, ok, c.value)
		}
	}
	m.Remove(id)
	if _, ok := gauge(t, pr, "smg_worker_cb_outcomes_total", map[string]string{"outcome": "failure", "worker": u}); ok {
		t.Fatal("removed worker kept its breaker series")
	}
	if _, ok := gauge(t, pr, "smg_worker_health", map[string]string{"worker": u}); ok {
		t.Fatal("removed worker kept its health gauge")
	}
}

// gauge finds one sample (counter or gauge) by name and exact labels.
func gauge(t *testing.T, g prometheus.Gatherer, name string, labels map[string]string) (float64, bool) {
	t.Helper()
	mfs, err := g.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	next:
		for _, m := range mf.GetMetric() {
			if len(m.GetLabel()) != len(labels) {
				continue
			}
			for _, l := range m.GetLabel() {
				if labels[l.GetName()] != l.GetValue() {
					continue next
				}
			}
			if m.Counter != nil {
				return m.Counter.GetValue(), true
			}
			return m.Gauge.GetValue(), true
		}
	}
	return 0, false
}

func TestMetricsNilSafe(t *testing.T) {
	var m *Metrics
	w := NewWorker("http://a", Regular, 0)
	m.Selected(w, "random")
	m.WorkerError(w, "x")
	m.Retry(Regular, "chat", 1, time.Millisecond)
	m.RetriesExhausted(Regular, "chat")
	if m.watch(NewRegistry()) != nil {
		t.Fatal("nil metrics watch failed")
	}
}

func TestMetricsPolicyBranches(t *testing.T) {
	pr := prometheus.NewRegistry()
	met, err := NewMetrics(pr)
	if err != nil {
		t.Fatal(err)
	}
	ws := testWorkers(2)
	o := PolicyOptions{Metrics: met}
	NewConsistentHashing(o).Select(ws, withHeaders(HeaderRoutingKey, "k"))
	man := NewManual(o)
	man.Select(ws, withHeaders(HeaderRoutingKey, "k"))
	man.Select(ws, withHeaders(HeaderRoutingKey, "k"))
	NewPrefixHash(o).Select(ws, &Request{Text: "hello"})
	NewCacheAware(o).Select(ws, &Request{Text: "hello"})
	for _, c := range []struct{ name, branch string }{
		{"smg_consistent_hashing_policy_branch_total", "routing_key"},
		{"smg_manual_policy_branch_total", "new_key"},
		{"smg_manual_policy_branch_total", "hit"},
		{"smg_prefix_hash_policy_branch_total", "hash"},
		{"smg_cache_aware_policy_branch_total", "miss"},
	} {
		if v, ok := gauge(t, pr, c.name, map[string]string{"branch": c.branch}); !ok || v != 1 {
			t.Errorf("%s{branch=%q} = %v (found %v), want 1", c.name, c.branch, v, ok)
		}
	}
	if v, _ := gauge(t, pr, "smg_manual_policy_cache_entries", map[string]string{}); v != 1 {
		t.Errorf("manual cache entries = %v, want 1", v)
	}
}

// Selected caches a worker's last counter: a change of policy, model or
// registry must still count under its own labels.
func TestMetricsSelectedCountsEachLabelSet(t *testing.T) {
	regA, regB := prometheus.NewRegistry(), prometheus.NewRegistry()
	a, err := NewMetrics(regA)
	if err != nil {
		t.Fatal(err)
	}
	b, err := NewMetrics(regB)
	if err != nil {
		t.Fatal(err)
	}
	a.Selected(&Worker{Type: Regular, ModelID: "m1"}, "random") // no state: counted, not cached
	w := NewWorker("http://a", Regular, 0)
	w.ModelID = "m1"
	a.Selected(w, "random")
	a.Selected(w, "round_robin")
	a.Selected(w, "random")
	b.Selected(w, "random")
	w.ModelID = "m2"
	a.Selected(w, "random")
	for _, c := range []struct {
		reg           *prometheus.Registry
		model, policy string
		want          float64
	}{
		{regA, "m1", "random", 3}, {regA, "m1", "round_robin", 1}, {regA, "m2", "random", 1}, {regB, "m1", "random", 1},
	} {
		got, ok := gauge(t, c.reg, "smg_worker_selection_total", map[string]string{"connection_mode": "http", "model": c.model, "policy": c.policy, "worker_type": "regular"})
		if !ok || got != c.want {
			t.Errorf("%s/%s: %v (found %v), want %v", c.model, c.policy, got, ok, c.want)
		}
	}
}
