package router_test

import (
	"sync"
	"testing"
	"time"

	"github.com/pdrouter/pdrouter/mock/mockworker"
)

// power_of_two and /get_loads read SGLang's /v1/loads, and /get_load only
// from an engine without it.
func TestLoadsFromV1LoadsWithFallback(t *testing.T) {
	t.Parallel()
	newer := startWorker(t, "regular", "--prefill-delay", "10s")
	older := startWorker(t, "regular", "--no-v1-loads", "--prefill-delay", "10s")
	r := startRouter(t, "--worker-urls", newer.URL(), older.URL(), "--policy", "power_of_two",
		"--worker-startup-check-interval", "1")
	newer.waitStats(t, 10*time.Second, "a /v1/loads poll", func(s mockworker.Stats) bool { return s.V1LoadPolls > 0 })
	older.waitStats(t, 10*time.Second, "a /get_load poll", func(s mockworker.Stats) bool { return s.GetLoadPolls > 0 })

	// A request in flight on each worker makes their reported loads non-zero.
	// The second is sent once the first is in flight, so power_of_two sees
	// the first's load (two picks at once could both take one worker).
	var clients sync.WaitGroup
	defer clients.Wait()
	inFlight := func() int64 { return newer.stats(t).InFlight + older.stats(t).InFlight }
	for i := range int64(2) {
		clients.Go(func() { leave(t, r.url+"/generate", `{"text":"one two three"}`, false, 3*time.Second) })
		for deadline := time.Now().Add(10 * time.Second); inFlight() <= i; time.Sleep(10 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("request %d not in flight within 10s", i+1)
			}
		}
	}
	for _, w := range []worker{newer, older} {
		w.waitStats(t, 10*time.Second, "a request in flight", func(s mockworker.Stats) bool { return s.InFlight > 0 })
	}
	var loads struct {
		Loads []struct {
			Worker string `json:"worker"`
			Load   int64  `json:"load"`
		} `json:"loads"`
		Successful int `json:"successful"`
	}
	getJSON(t, r.url+"/get_loads", &loads)
	if loads.Successful != 2 {
		t.Fatalf("/get_loads: %+v", loads)
	}
	for _, l := range loads.Loads {
		if l.Load <= 0 {
			t.Errorf("worker %s: load %d with a request in flight", l.Worker, l.Load)
		}
	}
	if s := newer.stats(t); s.GetLoadPolls != 0 {
		t.Errorf("an engine with /v1/loads was asked /get_load %d times", s.GetLoadPolls)
	}
	if s := older.stats(t); s.V1LoadPolls != 0 {
		t.Errorf("the engine without /v1/loads answered it %d times", s.V1LoadPolls)
	}
}
