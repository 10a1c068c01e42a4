package balancer

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"
)

func newTestManager(t *testing.T, cfg ManagerConfig) *Manager {
	if cfg.StartupInterval == 0 {
		cfg.StartupInterval = 20 * time.Millisecond
	}
	cfg.Health.Disabled = true
	m := NewManager(cfg)
	t.Cleanup(m.Stop)
	return m
}

// The router starts with a worker that is down; it registers once it is up.
func TestManagerRegistersWorkerThatWasDown(t *testing.T) {
	e := newFakeEngine(t, 503)
	m := newTestManager(t, ManagerConfig{})
	id, err := m.Add(WorkerSpec{URL: e.URL + "/", WorkerType: "regular"})
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, "probing", func() bool { return e.probes.Load() >= 2 })
	info, ok := m.Get(id)
	if !ok || info.JobStatus == nil || info.JobStatus.Status != JobProcessing || info.IsHealthy {
		t.Fatalf("pending worker info: %+v", info)
	}
	if m.Ready() || len(m.List()) != 0 {
		t.Fatal("ready or listed before registration finished")
	}
	e.healthStatus.Store(200)
	if err := m.Await(context.Background(), id); err != nil {
		t.Fatal(err)
	}
	info, _ = m.Get(e.URL)
	if info.JobStatus != nil || !info.IsHealthy || info.ModelID != "mock-model" || info.URL != e.URL {
		t.Fatalf("registered worker info: %+v", info)
	}
	if !m.Ready() || len(m.Snapshot().Available(Regular)) != 1 {
		t.Fatal("registered worker not ready")
	}
}

func TestManagerModelDiscoveryFallbacks(t *testing.T) {
	old := newFakeEngine(t, 200)
	old.oldInfoOnly = true
	old.serverInfo = map[string]any{"model_path": "/models/llama", "served_model_name": nil}
	explicit := newFakeEngine(t, 200)
	m := newTestManager(t, ManagerConfig{})
	id1, _ := m.Add(WorkerSpec{URL: old.URL})
	id2, _ := m.Add(WorkerSpec{URL: explicit.URL, ModelID: "mine"})
	for _, id := range []string{id1, id2} {
		if err := m.Await(context.Background(), id); err != nil {
			t.Fatal(err)
		}
	}
	if got := m.Snapshot().ByID(id1).ModelID; got != "/models/llama" {
		t.Fatalf("model from /get_server_info model_path = %q", got)
	}
	if got := m.Snapshot().ByID(id2).ModelID; got != "mine" {
		t.Fatalf("explicit model id overridden: %q", got)
	}
}

func TestManagerStartupTimeoutFailsJob(t *testing.T) {
	e := newFakeEngine(t, 503)
	m := newTestManager(t, ManagerConfig{StartupTimeout: 100 * time.Millisecond})
	id, _ := m.Add(WorkerSpec{URL: e.URL})
	if err := m.Await(context.Background(), id); err == nil || !strings.Contains(err.Error(), "timeout") {
		t.Fatalf("await: %v, want a timeout", err)
	}
	info, ok := m.Get(id)
	if !ok || info.JobStatus == nil || info.JobStatus.Status != JobFailed || info.JobStatus.Message == "" {
		t.Fatalf("failed job info: %+v", info)
	}
	// A failed registration may be retried.
	e.healthStatus.Store(200)
	id2, err := m.Add(WorkerSpec{URL: e.URL})
	if err != nil || m.Await(context.Background(), id2) != nil {
		t.Fatal("retry after failure:", err)
	}
}

func TestManagerValidationAndDuplicates(t *testing.T) {
	e := newFakeEngine(t, 200)
	m := newTestManager(t, ManagerConfig{})
	for _, bad := range []WorkerSpec{{URL: "localhost:1"}, {URL: "ftp://x"}, {URL: e.URL, WorkerType: "bogus"}} {
		if _, err := m.Add(bad); !errors.Is(err, ErrInvalidWorker) {
			t.Errorf("%+v: %v, want ErrInvalidWorker", bad, err)
		}
	}
	id, _ := m.Add(WorkerSpec{URL: e.URL, WorkerType: "prefill", BootstrapPort: 8998})
	if got, err := m.Add(WorkerSpec{URL: e.URL}); !errors.Is(err, ErrWorkerExists) || got != id {
		t.Fatalf("duplicate while pending: %q %v", got, err)
	}
	m.Await(context.Background(), id)
	if _, err := m.Add(WorkerSpec{URL: e.URL}); !errors.Is(err, ErrWorkerExists) {
		t.Fatalf("duplicate when registered: %v", err)
	}
	w := m.Snapshot().ByID(id)
	if w.Type != Prefill || w.BootstrapPort != 8998 || w.BootstrapHost != "127.0.0.1" {
		t.Fatalf("prefill attributes: %+v", w)
	}
}

func TestManagerRemoveAndUpdate(t *testing.T) {
	up, down := newFakeEngine(t, 200), newFakeEngine(t, 503)
	m := newTestManager(t, ManagerConfig{})
	id, _ := m.Add(WorkerSpec{URL: up.URL})
	m.Await(context.Background(), id)
	pending, _ := m.Add(WorkerSpec{URL: down.URL})
	if _, ok := m.Remove(down.URL); !ok {
		t.Fatal("pending registration not removable by URL")
	}
	if err := m.Await(context.Background(), pending); !errors.Is(err, ErrWorkerNotFound) {
		t.Fatalf("removed job: %v", err)
	}

	w := m.Snapshot().ByID(id)
	w.IncLoad() // an in-flight request
	prio, cost := uint32(7), float32(2.5)
	info, err := m.Update(id, WorkerUpdate{Priority: &prio, Cost: &cost, Labels: map[string]string{"zone": "a"}})
	if err != nil || info.Priority != 7 || info.Cost != 2.5 || info.Metadata["zone"] != "a" {
		t.Fatalf("update: %+v %v", info, err)
	}
	nw := m.Snapshot().ByID(id)
	if nw == w || nw.Load() != 1 {
		t.Fatal("update must publish a copy sharing the in-flight count")
	}
	w.DecLoad() // the old pointer finishes its request
	if nw.Load() != 0 {
		t.Fatal("load not shared between copies")
	}
	if _, ok := m.Remove(id); !ok || m.Snapshot().ByID(id) != nil {
		t.Fatal("remove by id")
	}
	if _, err := m.Update(id, WorkerUpdate{}); !errors.Is(err, ErrWorkerNotFound) {
		t.Fatal("update of removed worker:", err)
	}
}

func TestManagerReadinessPD(t *testing.T) {
	p, d := newFakeEngine(t, 200), newFakeEngine(t, 200)
	m := newTestManager(t, ManagerConfig{PD: true})
	pid, _ := m.Add(WorkerSpec{URL: p.URL, WorkerType: "prefill"})
	m.Await(context.Background(), pid)
	if m.Ready() {
		t.Fatal("ready with only a prefill worker")
	}
	did, _ := m.Add(WorkerSpec{URL: d.URL, WorkerType: "decode"})
	m.Await(context.Background(), did)
	if !m.Ready() {
		t.Fatal("not ready with a PD pair")
	}
	m.Snapshot().ByID(did).SetHealthy(false)
	if m.Ready() {
		t.Fatal("ready without a healthy decode worker")
	}
}

func TestWorkerInfoJSON(t *testing.T) {
	w := NewWorker("http://[::1]:30001", Prefill, 8998)
	w.ID = "abc"
	b, _ := json.Marshal(w.Info())
	want := `{"id":"abc","url":"http://[::1]:30001","model_id":"unknown","priority":50,"cost":1,"worker_type":"prefill","is_healthy":true,"load":0,"connection_mode":"http","disable_health_check":false,"bootstrap_port":8998}`
	if string(b) != want {
		t.Fatalf("got  %s\nwant %s", b, want)
	}
	if w.BootstrapHost != "[::1]" {
		t.Fatal(w.BootstrapHost)
	}
}

func TestLoadMonitorSumsRanks(t *testing.T) {
	e := newFakeEngine(t, 200)
	e.load.Store(41)
	m := NewManager(ManagerConfig{LoadPollInterval: 10 * time.Millisecond, Health: HealthConfig{Disabled: true}, StartupInterval: 10 * time.Millisecond})
	defer m.Stop()
	id, _ := m.Add(WorkerSpec{URL: e.URL})
	m.Await(context.Background(), id)
	m.Start()
	w := m.Snapshot().ByID(id)
	waitFor(t, "a load report", func() bool { n, ok := w.ReportedLoad(); return ok && n == 41 })
	if n, err := parseLoad([]byte(`{"load": 9}`), -1); err != nil || n != 9 {
		t.Fatalf("legacy {load}: %d %v", n, err)
	}
}

// Attached policies hear about removals and run their sweeps until Stop.
func TestManagerAttachPolicy(t *testing.T) {
	e1, e2 := newFakeEngine(t, 200), newFakeEngine(t, 200)
	m := newTestManager(t, ManagerConfig{})
	ca := NewCacheAware(PolicyOptions{EvictionInterval: 5 * time.Millisecond})
	m.AttachPolicy(ca)
	m.AttachPolicy(Random{}) // stateless: nothing to attach
	for _, u := range []string{e1.URL, e2.URL} {
		id, _ := m.Add(WorkerSpec{URL: u})
		m.Await(context.Background(), id)
	}
	ws := m.Snapshot().Available(Regular)
	for i := range 10 {
		ca.Select(ws, &Request{Text: strings.Repeat(string(rune('a'+i)), 40)})
	}
	before := ca.TreeBytes()
	m.Remove(e1.URL)
	waitFor(t, "the sweep", func() bool { return ca.TreeBytes() < before })
}

// Zero fields take DefaultManagerConfig's values; set ones stay.
func TestNewManagerDefaults(t *testing.T) {
	m := NewManager(ManagerConfig{Health: HealthConfig{Timeout: time.Second, Disabled: true}})
	defer m.Stop()
	d := DefaultManagerConfig()
	want := d.Health
	want.Timeout, want.Disabled = time.Second, true
	if m.cfg.Health != want || m.cfg.Breaker != d.Breaker ||
		m.cfg.StartupTimeout != d.StartupTimeout || m.cfg.StartupInterval != d.StartupInterval {
		t.Errorf("config %+v, want the defaults with a 1s health timeout", m.cfg)
	}
}

// Attaching a policy that reads engine loads turns the /get_load poll on at
// the startup check interval; other policies leave it off.
func TestManagerPollsLoadForPolicyThatReadsIt(t *testing.T) {
	for _, c := range []struct {
		policy Policy
		polls  bool
	}{{PowerOfTwo{}, true}, {Random{}, false}} {
		e := newFakeEngine(t, 200)
		e.load.Store(7)
		m := newTestManager(t, ManagerConfig{StartupInterval: 10 * time.Millisecond})
		m.AttachPolicy(c.policy)
		id, _ := m.Add(WorkerSpec{URL: e.URL})
		if err := m.Await(context.Background(), id); err != nil {
			t.Fatal(err)
		}
		if err := m.Start(); err != nil {
			t.Fatal(err)
		}
		w := m.Snapshot().ByID(id)
		if c.polls {
			waitFor(t, "a load report", func() bool { n, ok := w.ReportedLoad(); return ok && n == 7 })
			continue
		}
		time.Sleep(50 * time.Millisecond) // five poll periods
		if _, ok := w.ReportedLoad(); ok {
			t.Errorf("%s: /get_load polled", c.policy.Name())
		}
	}
}

// Concurrent updates of different fields both land: each applies to the
// worker as published at the time, not to a copy another update replaced.
func TestManagerConcurrentUpdatesKeepBoth(t *testing.T) {
	m := NewManager(ManagerConfig{})
	defer m.Stop()
	w := NewWorker("http://10.0.0.1:1", Regular, NoBootstrapPort)
	m.reg.Add(w)
	const n = 2000
	lost := make(chan string, 2)
	var wg sync.WaitGroup
	wg.Go(func() {
		for i := uint32(1); i <= n; i++ {
			m.Update(w.ID, WorkerUpdate{Priority: &i})
			if p := m.Snapshot().ByID(w.ID).Priority; p != i {
				lost <- fmt.Sprintf("priority %d set, %d published", i, p)
				return
			}
		}
	})
	wg.Go(func() {
		for i := 1; i <= n; i++ {
			c := float32(i)
			m.Update(w.ID, WorkerUpdate{Cost: &c})
			if got := m.Snapshot().ByID(w.ID).Cost; got != c {
				lost <- fmt.Sprintf("cost %v set, %v published", c, got)
				return
			}
		}
	})
	wg.Wait()
	close(lost)
	for msg := range lost {
		t.Error("lost update:", msg)
	}
}
