package balancer

import (
	"net/http"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// fakeNet answers health probes in memory, so that stall detection runs in
// a synctest bubble on its fake clock: per host a status, or hang until
// the probe's deadline, as a SIGSTOPped process whose kernel still
// completes handshakes.
type fakeNet struct {
	mu     sync.Mutex
	status map[string]int // by host; hang when absent
}

const hang = 0

func (f *fakeNet) set(url string, status int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.status[strings.TrimPrefix(url, "http://")] = status
}

func (f *fakeNet) RoundTrip(r *http.Request) (*http.Response, error) {
	f.mu.Lock()
	st := f.status[r.URL.Host]
	f.mu.Unlock()
	if st == hang {
		<-r.Context().Done()
		return nil, r.Context().Err()
	}
	return &http.Response{StatusCode: st, Body: http.NoBody, Header: http.Header{}, Request: r}, nil
}

// stallPool starts, in the caller's bubble, a manager with the default
// breaker and health settings (those cfg leaves zero) over one decode
// worker per status, whose probes the returned fakeNet answers with it.
func stallPool(t *testing.T, cfg ManagerConfig, status ...int) (*Manager, []*Worker, *fakeNet, *prometheus.Registry) {
	t.Helper()
	pr := prometheus.NewRegistry()
	met, err := NewMetrics(pr)
	if err != nil {
		t.Fatal(err)
	}
	fn := &fakeNet{status: map[string]int{}}
	cfg.Metrics, cfg.Client = met, &http.Client{Transport: fn}
	m := NewManager(cfg)
	ws := make([]*Worker, len(status))
	for i, st := range status {
		u := "http://10.0.0." + string(rune('1'+i)) + ":30000"
		fn.set(u, st)
		w, err := m.newWorker(WorkerSpec{URL: u, WorkerType: "decode"})
		if err != nil {
			t.Fatal(err)
		}
		met.instrument(w)
		ws[i], _ = m.reg.Add(w)
	}
	if err := m.Start(); err != nil {
		t.Fatal(err)
	}
	return m, ws, fn, pr
}

// after sleeps d on the bubble's clock and lets every goroutine settle.
func after(d time.Duration) {
	time.Sleep(d)
	synctest.Wait()
}

func availableHas(m *Manager, w *Worker) bool {
	for _, a := range m.Snapshot().Available(Decode) {
		if a == w {
			return true
		}
	}
	return false
}

// With the defaults (10 s stall timeout, 5 s probe timeout) a worker that
// stops answering is steered around within 3 s, once its probe hangs, and
// ejected at the stall timeout.
func TestHungWorkerSuspectWithinSeconds(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m, ws, _, pr := stallPool(t, ManagerConfig{}, hang, 200)
		defer m.Stop()
		hung := ws[0]
		after(5 * time.Second) // the first health round hangs on the hung worker until its timeout
		hung.AwaitReply()
		after(3 * time.Second)
		if !hung.Suspect() || availableHas(m, hung) {
			t.Fatalf("3 s into the stall: hung worker suspect %v, available %v; want steered around", hung.Suspect(), availableHas(m, hung))
		}
		after(7500 * time.Millisecond)
		if hung.Available() {
			t.Fatal("10.5 s into the stall, its probes failing: the hung worker is not ejected")
		}
		labels := map[string]string{"worker_type": "decode", "reason": "stall"}
		if v, _ := gauge(t, pr, "smg_worker_outlier_ejections_total", labels); v != 1 {
			t.Errorf("stall ejections = %v, want 1", v)
		}
		hung.ReplyDone(false)
	})
}

// A worker busy with long non-streamed generations (no reply head for a
// minute) whose probe passes is neither suspect nor ejected: the first-byte
// timeout alone does not make it an outlier.
func TestBusyWorkerWithPassingProbeIsNotSuspect(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m, ws, _, pr := stallPool(t, ManagerConfig{}, 200, 200)
		defer m.Stop()
		busy, idle := ws[0], ws[1]
		busy.AwaitReply()
		for range 60 {
			after(time.Second)
			if busy.Suspect() || !availableHas(m, busy) || idle.Suspect() {
				t.Fatalf("a long generation, probes passing: suspect %v, available %v; idle suspect %v",
					busy.Suspect(), availableHas(m, busy), idle.Suspect())
			}
		}
		if v, _ := gauge(t, pr, "smg_worker_outlier_suspect", map[string]string{"worker": busy.URL}); v != 0 {
			t.Errorf("suspect gauge of the busy worker = %v, want 0", v)
		}
		busy.ReplyDone(true)
	})
}

// A worker whose own health probe already fails is suspect as soon as a
// request has waited one sweep period (1 s with the defaults).
func TestFailingProbeMakesShortStallSuspect(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m, ws, _, _ := stallPool(t, ManagerConfig{}, 503, 200)
		defer m.Stop()
		sick := ws[0]
		after(100 * time.Millisecond) // the first health round: 503, below the failure threshold
		if !sick.Healthy() {
			t.Fatal("one failed probe made the worker unhealthy")
		}
		sick.AwaitReply()
		after(2 * time.Second)
		if !sick.Suspect() || availableHas(m, sick) {
			t.Fatalf("2 s into a stall after a failed probe: suspect %v, available %v", sick.Suspect(), availableHas(m, sick))
		}
		sick.ReplyDone(true)
		if sick.Suspect() || !availableHas(m, sick) {
			t.Fatal("still steered around after it answered")
		}
	})
}

// A stall ejection outlasts its time while probes fail, and ends on the
// first passing one.
func TestStallEjectionEndsOnPassingProbe(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		cfg := ManagerConfig{Breaker: DefaultBreakerConfig()}
		cfg.Breaker.OpenDuration = 5 * time.Second
		m, ws, fn, pr := stallPool(t, cfg, 200, 200)
		defer m.Stop()
		w := ws[0]
		fn.set(w.URL, hang)
		w.AwaitReply()
		after(11 * time.Second)
		if w.Available() {
			t.Fatal("not ejected")
		}
		w.ReplyDone(false) // the stuck request gave up: nothing holds the worker now
		for range 30 {     // asked all along, as traffic would: never available past the 5 s
			after(time.Second)
			if w.Available() {
				t.Fatal("available while its probes fail")
			}
		}
		labels := map[string]string{"worker_type": "decode", "reason": "stall"}
		if v, _ := gauge(t, pr, "smg_worker_outlier_ejections_total", labels); v != 1 {
			t.Fatalf("stall ejections = %v, want 1 (failed probes hold it open)", v)
		}
		fn.set(w.URL, 200)
		after(7 * time.Second) // the probe in flight hangs up to 5 s, the next one passes
		if !w.Available() || w.Breaker.State() != BreakerHalfOpen {
			t.Fatalf("after a passing probe: available %v, state %v, want half_open", w.Available(), w.Breaker.State())
		}
	})
}

// A stall caught while the pool is at its cap is refused, and counted once
// per failed probe.
func TestStallEjectionRespectsCap(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m, ws, _, pr := stallPool(t, ManagerConfig{}, hang, hang)
		defer m.Stop()
		for _, w := range ws {
			w.AwaitReply()
		}
		after(20 * time.Second)
		if ws[0].Available() == ws[1].Available() {
			t.Fatalf("available: %v and %v, want exactly one (50 %% of two)", ws[0].Available(), ws[1].Available())
		}
		labels := map[string]string{"worker_type": "decode", "reason": "stall"}
		if v, _ := gauge(t, pr, "smg_worker_outlier_ejections_overflow_total", labels); v < 1 || v > 3 {
			t.Fatalf("refused ejections in 10 s past the stall timeout = %v, want 1 to 3 (one per failed 5 s probe)", v)
		}
		for _, w := range ws {
			w.ReplyDone(false)
		}
	})
}

// Every policy steers around a suspect worker: Available leaves it out
// while another answers, and keeps it when every worker is suspect.
func TestEveryPolicySteersAroundSuspect(t *testing.T) {
	reg := NewRegistry()
	ws := make([]*Worker, 3)
	for i := range ws {
		ws[i], _ = reg.Add(NewWorker("http://10.0.0."+string(rune('1'+i))+":1", Decode, NoBootstrapPort))
	}
	ws[1].Breaker.out.suspect.Store(true)
	text := strings.Repeat("shared prefix ", 20)
	for _, info := range Policies() {
		p, _ := NewPolicy(info.Name, PolicyOptions{})
		p.Select([]*Worker{ws[1]}, &Request{Text: text}) // whatever a policy remembers points at the suspect
		for i := range 50 {
			req := withHeaders(HeaderRoutingKey, "k"+string(rune('a'+i%26)))
			req.Text = text
			if w, _ := p.Select(reg.Snapshot().Available(Decode), req); w == ws[1] {
				t.Fatalf("%s picked the suspect worker", info.Name)
			}
		}
	}
	for _, w := range ws {
		w.Breaker.out.suspect.Store(true)
	}
	if n := len(reg.Snapshot().Available(Decode)); n != 3 {
		t.Fatalf("%d available when every worker is suspect, want all 3", n)
	}
}
