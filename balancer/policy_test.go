package balancer

import (
	"fmt"
	"net/http"
	"slices"
	"testing"
	"time"
)

func testWorkers(n int) []*Worker {
	ws := make([]*Worker, n)
	for i := range ws {
		ws[i] = NewWorker(fmt.Sprintf("http://10.0.0.%d:30000", i+1), Regular, NoBootstrapPort)
	}
	return ws
}

func withHeaders(kv ...string) *Request {
	h := http.Header{}
	for i := 0; i < len(kv); i += 2 {
		h.Set(kv[i], kv[i+1])
	}
	return &Request{Header: h}
}

func counts(t *testing.T, p Policy, ws []*Worker, n int, req func(i int) *Request) map[*Worker]int {
	t.Helper()
	c := map[*Worker]int{}
	for i := range n {
		w, err := p.Select(ws, req(i))
		if err != nil {
			t.Fatal(err)
		}
		c[w]++
	}
	return c
}

func TestNewPolicyAllNames(t *testing.T) {
	ws := testWorkers(1)
	for _, name := range PolicyNames(true) {
		p, err := NewPolicy(name, PolicyOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if p.Name() != name {
			t.Errorf("%s reports name %q", name, p.Name())
		}
		for _, req := range []*Request{nil, {}, {Text: "hello"}} {
			if w, err := p.Select(ws, req); err != nil || w != ws[0] {
				t.Errorf("%s with one worker and %+v: %v %v", name, req, w, err)
			}
		}
	}
	if _, err := NewPolicy("bogus", PolicyOptions{}); err == nil {
		t.Fatal("unknown policy accepted")
	}
}

func TestRandomRoughlyUniform(t *testing.T) {
	ws := testWorkers(4)
	c := counts(t, Random{}, ws, 40000, func(int) *Request { return nil })
	for _, w := range ws {
		if c[w] < 9000 || c[w] > 11000 {
			t.Fatalf("random counts %v not within 10%% of 10000", c)
		}
	}
}

func TestRoundRobinExact(t *testing.T) {
	ws := testWorkers(3)
	rr := &RoundRobin{}
	for i := range 9 {
		if w, _ := rr.Select(ws, nil); w != ws[i%3] {
			t.Fatalf("pick %d went to %s", i, w.URL)
		}
	}
}

func TestPowerOfTwoPrefersLessLoaded(t *testing.T) {
	ws := testWorkers(4)
	for i, w := range ws {
		for range i * 3 {
			w.IncLoad() // loads 0, 3, 6, 9
		}
	}
	c := counts(t, PowerOfTwo{}, ws, 6000, func(int) *Request { return nil })
	if c[ws[3]] != 0 {
		t.Fatalf("most loaded worker picked %d times", c[ws[3]])
	}
	// The least loaded wins every pair it is in: 3 of the 6 pairs.
	if c[ws[0]] < 2700 || c[ws[0]] > 3300 || c[ws[0]] <= c[ws[1]] || c[ws[1]] <= c[ws[2]] {
		t.Fatalf("counts %v not ordered by load", c)
	}
}

// An engine that reported idle at the last poll stops looking idle once the
// router has sent it requests since.
func TestPowerOfTwoNoHerdingOnStaleReports(t *testing.T) {
	ws := testWorkers(2)
	ws[0].setReportedLoad(4000, true) // busy engine: 4000 tokens for 4 requests
	for range 4 {
		ws[0].IncLoad()
	}
	ws[0].setReportedLoad(4000, true)
	ws[1].setReportedLoad(0, true)
	picked := 0
	for range 20 {
		w, _ := PowerOfTwo{}.Select(ws, nil)
		if w == ws[1] {
			picked++
		}
		w.IncLoad()
	}
	// 4 picks to catch up (1000 tokens per request), then the 16 others alternate.
	if picked < 10 || picked > 14 {
		t.Fatalf("stale-idle worker took %d of 20, want ~12 (all 20 would be herding)", picked)
	}
}

// The table is the one list of policies: PD prefill sides take every row,
// other sides every row but the prefill-only ones.
func TestPolicyTable(t *testing.T) {
	all, others := PolicyNames(true), PolicyNames(false)
	if len(all) != len(Policies()) || len(others) >= len(all) {
		t.Fatalf("prefill side %v, other sides %v", all, others)
	}
	seen := map[string]bool{}
	for _, p := range Policies() {
		if seen[p.Name] || p.Summary == "" {
			t.Errorf("row %+v: duplicate or without a summary", p)
		}
		seen[p.Name] = true
		if slices.Contains(others, p.Name) == p.PrefillOnly {
			t.Errorf("%s: prefill only %v, yet other sides list it: %v", p.Name, p.PrefillOnly, others)
		}
		if got, ok := LookupPolicy(p.Name); !ok || got.Name != p.Name {
			t.Errorf("LookupPolicy(%q) = %+v, %v", p.Name, got, ok)
		}
	}
	if !seen["bucket"] || slices.Contains(others, "bucket") {
		t.Errorf("bucket must be a prefill-only row: %v", others)
	}
	if _, ok := LookupPolicy("fastest"); ok {
		t.Error("LookupPolicy found a policy that is not in the table")
	}
}

// Zero options take DefaultPolicyOptions; set ones stay; periods and sizes
// that are not positive count as unset.
func TestPolicyOptionsDefaults(t *testing.T) {
	d := DefaultPolicyOptions()
	if got := (PolicyOptions{}).withDefaults(); got != d {
		t.Errorf("zero options: %+v, want %+v", got, d)
	}
	set := PolicyOptions{CacheThreshold: 0.9, EvictionInterval: time.Second, AssignmentMode: "min_load", LoadFactor: 2}
	if got := set.withDefaults(); got.CacheThreshold != 0.9 || got.EvictionInterval != time.Second ||
		got.AssignmentMode != "min_load" || got.LoadFactor != 2 || got.MaxTreeSize != d.MaxTreeSize {
		t.Errorf("set options changed: %+v", got)
	}
	bad := PolicyOptions{EvictionInterval: -time.Second, BucketAdjustInterval: -1, MaxTreeSize: -1, LoadFactor: 0.5}
	if got := bad.withDefaults(); got.EvictionInterval != d.EvictionInterval || got.BucketAdjustInterval != d.BucketAdjustInterval ||
		got.MaxTreeSize != d.MaxTreeSize || got.LoadFactor != d.LoadFactor {
		t.Errorf("non-positive options kept: %+v", got)
	}
}
