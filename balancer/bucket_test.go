package balancer

import (
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
