package balancer

import (
	"fmt"
	"strings"
	"testing"
)

func TestBucketRoutesByLength(t *testing.T) {
	ws := testWorkers(2)
	b := NewBucket(PolicyOptions{BalanceAbsThreshold: 1 << 40}) // isolate the ranges
	for i := range 100 {                                        // lengths 1..100 and 900..1098
		b.Select(ws, &Request{Text: strings.Repeat("s", 1+i)})
		b.Select(ws, &Request{Text: strings.Repeat("l", 900+2*i)})
	}
	b.adjust()
	short, long := &Request{Text: strings.Repeat("s", 10)}, &Request{Text: strings.Repeat("l", 1090)}
	for range 10 {
		if w, _ := b.Select(ws, short); w != ws[0] {
			t.Fatal("short prompt left the short range")
		}
		if w, _ := b.Select(ws, long); w != ws[1] {
			t.Fatal("long prompt left the long range")
		}
	}
}

func TestBucketImbalanceGoesToFewestChars(t *testing.T) {
	ws := testWorkers(3)
	b := NewBucket(PolicyOptions{})
	b.slotsFor(ws)
	b.chars[0], b.chars[1], b.chars[2] = 5000, 100, 4000
	if w, _ := b.Select(ws, &Request{Text: "x"}); w != ws[1] {
		t.Fatal("imbalanced characters did not go to the least-used worker")
	}
}

// Policies that keep per-URL state (cache_aware's tenant table, bucket's
// slots) stay as big as the pool when workers are removed and others added
// under new URLs, again and again.
func TestPolicyStateBoundedOverWorkerChurn(t *testing.T) {
	reg := NewRegistry()
	ca, bk := NewCacheAware(PolicyOptions{}), NewBucket(PolicyOptions{})
	reg.OnChange(ca.WorkersChanged)
	reg.OnChange(bk.WorkersChanged)
	stay, _ := reg.Add(NewWorker("http://10.0.0.1:1", Prefill, NoBootstrapPort))
	for i := range 500 {
		w, _ := reg.Add(NewWorker(fmt.Sprintf("http://10.1.%d.%d:1", i/250, i%250), Prefill, NoBootstrapPort))
		ws := reg.Snapshot().Available(Prefill)
		ca.Select(ws, &Request{Text: fmt.Sprintf("prompt %d", i)})
		bk.Select(ws, &Request{Text: "prompt"})
		reg.Remove(w.URL)
		ca.sweep()
	}
	ca.Select([]*Worker{stay}, &Request{Text: "x"})
	bk.Select([]*Worker{stay}, &Request{Text: "x"})
	if n := len(ca.urls); n > 2 {
		t.Errorf("cache_aware tenant table holds %d ids after 500 removed workers, want <= 2", n)
	}
	if n := len(bk.chars); n > 2 {
		t.Errorf("bucket holds %d slots after 500 removed workers, want <= 2", n)
	}
}
