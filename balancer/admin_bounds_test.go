package balancer

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/pdrouter/pdrouter/mock/mockworker"
)

// series counts the samples of a metric family.
func series(t *testing.T, g prometheus.Gatherer, name string) int {
	t.Helper()
	mfs, err := g.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name {
			return len(mf.GetMetric())
		}
	}
	return 0
}

// Adding and removing workers leaves no breaker series behind: not for
// registrations removed while pending, not for ones that failed, not for
// a --dp-aware engine's base URL.
func TestRemovedWorkersLeaveNoBreakerSeries(t *testing.T) {
	pr := prometheus.NewRegistry()
	met, err := NewMetrics(pr)
	if err != nil {
		t.Fatal(err)
	}
	m := newTestManager(t, ManagerConfig{Metrics: met, DPAware: true, StartupTimeout: 50 * time.Millisecond})
	for i := range 20 { // never up: removed while pending
		id, err := m.Add(WorkerSpec{URL: fmt.Sprintf("http://127.0.0.1:%d", 1+i)})
		if err != nil {
			t.Fatal(err)
		}
		m.Remove(id)
	}
	failed, _ := m.Add(WorkerSpec{URL: "http://127.0.0.1:40"}) // fails its startup timeout
	if err := m.Await(context.Background(), failed); err == nil {
		t.Fatal("a worker that is never up registered")
	}
	e := startMock(t, mockworker.Config{Engine: mockworker.EngineInfo{DPSize: 2}})
	register(t, m, WorkerSpec{URL: e.URL()})
	if n := series(t, pr, "smg_worker_cb_outcomes_total"); n != 4 {
		t.Fatalf("%d outcome series for one engine of 2 ranks, want 4", n)
	}
	m.Remove(e.URL())
	m.Remove(failed)
	if n := series(t, pr, "smg_worker_cb_outcomes_total"); n != 0 {
		t.Fatalf("%d outcome series after every worker was removed, want 0", n)
	}
}

// Registrations waiting for their workers are bounded; so are the failed
// ones kept for GET, the oldest forgotten first. (Workers never up: their
// probes hang, on synctest's clock.)
func TestRegistrationJobsBounded(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		client := &http.Client{Transport: &fakeNet{status: map[string]int{}}}
		m := NewManager(ManagerConfig{Client: client, StartupTimeout: time.Hour})
		defer m.Stop()
		m.maxPending, m.maxFailed = 3, 2
		for i := range 3 {
			if _, err := m.Add(WorkerSpec{URL: fmt.Sprintf("http://10.0.0.1:%d", 1+i)}); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := m.Add(WorkerSpec{URL: "http://10.0.0.1:9"}); !errors.Is(err, ErrTooManyPending) {
			t.Fatalf("4th pending registration: %v, want ErrTooManyPending", err)
		}
		for _, j := range m.jobsSnapshot() {
			m.Remove(j)
		}
		if _, err := m.Add(WorkerSpec{URL: "http://10.0.0.1:9"}); err != nil {
			t.Fatalf("after removing the pending ones: %v", err)
		}

		m2 := NewManager(ManagerConfig{Client: client, StartupTimeout: time.Minute})
		defer m2.Stop()
		m2.maxFailed = 2
		var ids []string
		for i := range 5 {
			id, _ := m2.Add(WorkerSpec{URL: fmt.Sprintf("http://10.0.0.2:%d", 1+i)})
			if err := m2.Await(context.Background(), id); err == nil {
				t.Fatal("registered a worker that is never up")
			}
			ids = append(ids, id)
		}
		if n := len(m2.jobsSnapshot()); n != 2 {
			t.Fatalf("%d failed jobs kept, want 2", n)
		}
		for i, id := range ids {
			if _, ok := m2.Get(id); ok != (i >= 3) {
				t.Errorf("failed job %d kept: %v, want only the last two", i, ok)
			}
		}
	})
}

func (m *Manager) jobsSnapshot() []string {
	m.mu.Lock()
	defer m.mu.Unlock()
	var ids []string
	for id := range m.jobs {
		ids = append(ids, id)
	}
	return ids
}

// A URL with userinfo names the engine without it: it is the same worker
// (a duplicate is refused), and the password shows neither in the worker
// list nor in the log nor in an error.
func TestUserinfoURLIsNormalisedAndRedacted(t *testing.T) {
	core, logs := observer.New(zap.DebugLevel)
	m := newTestManager(t, ManagerConfig{Logger: zap.New(core)})
	e := newFakeEngine(t, 200)
	host := strings.TrimPrefix(e.URL, "http://")
	id := register(t, m, WorkerSpec{URL: "HTTP://admin:hunter2@" + strings.ToUpper(host) + "/"})
	if got, err := m.Add(WorkerSpec{URL: e.URL}); !errors.Is(err, ErrWorkerExists) || got != id {
		t.Fatalf("the same engine without userinfo: %q %v, want ErrWorkerExists for %s", got, err, id)
	}
	if _, err := m.Add(WorkerSpec{URL: "http://other:pw@" + host}); !errors.Is(err, ErrWorkerExists) {
		t.Fatalf("the same engine with other userinfo: %v, want ErrWorkerExists", err)
	}
	list := fmt.Sprintf("%+v", m.List())
	if len(m.List()) != 1 || m.List()[0].URL != e.URL || strings.Contains(list, "hunter2") {
		t.Fatalf("workers %s, want one, %s", list, e.URL)
	}
	if _, ok := m.Get("http://admin:hunter2@" + host); !ok {
		t.Fatal("not found by the URL it was registered with")
	}
	if _, err := m.Add(WorkerSpec{URL: "ftp://admin:hunter2@x"}); !errors.Is(err, ErrInvalidWorker) || strings.Contains(err.Error(), "hunter2") {
		t.Fatalf("invalid URL: %v, want ErrInvalidWorker without the password", err)
	}
	m.Remove("http://admin:hunter2@" + host)
	if len(m.List()) != 0 {
		t.Fatal("not removed by the URL it was registered with")
	}
	for _, l := range logs.All() {
		if strings.Contains(fmt.Sprint(l.Message, l.ContextMap()), "hunter2") {
			t.Fatalf("the password is in the log: %s %v", l.Message, l.ContextMap())
		}
	}
}
