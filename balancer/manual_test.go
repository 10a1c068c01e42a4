package balancer

import (
	"fmt"
	"testing"
	"testing/synctest"
	"time"
)

func TestManualSticky(t *testing.T) {
	ws := testWorkers(4)
	m := NewManual(PolicyOptions{})
	first, _ := m.Select(ws, withHeaders(HeaderRoutingKey, "user-1"))
	for range 20 {
		if w, _ := m.Select(ws, withHeaders(HeaderRoutingKey, "user-1")); w != first {
			t.Fatal("routing key not sticky")
		}
	}
	// Its worker leaves: reassigned, then sticky to the new one.
	var rest []*Worker
	for _, w := range ws {
		if w != first {
			rest = append(rest, w)
		}
	}
	second, _ := m.Select(rest, withHeaders(HeaderRoutingKey, "user-1"))
	if second == first {
		t.Fatal("picked a worker that is gone")
	}
	if w, _ := m.Select(rest, withHeaders(HeaderRoutingKey, "user-1")); w != second {
		t.Fatal("reassigned key not sticky")
	}
	// It comes back: the key stays with the current worker.
	if w, _ := m.Select(ws, withHeaders(HeaderRoutingKey, "user-1")); w != second {
		t.Fatal("key jumped back to its previous worker")
	}
}

func TestManualAssignmentModes(t *testing.T) {
	ws := testWorkers(4)
	g := NewManual(PolicyOptions{AssignmentMode: "min_group"})
	per := map[*Worker]int{}
	for i := range 40 {
		w, _ := g.Select(ws, withHeaders(HeaderRoutingKey, fmt.Sprint("k", i)))
		per[w]++
	}
	for _, w := range ws {
		if per[w] != 10 {
			t.Fatalf("min_group did not even out keys: %v", per)
		}
	}
	l := NewManual(PolicyOptions{AssignmentMode: "min_load"})
	for i, w := range ws {
		if i != 1 {
			w.IncLoad()
		}
	}
	if w, _ := l.Select(ws, withHeaders(HeaderRoutingKey, "new")); w != ws[1] {
		t.Fatal("min_load did not pick the idle worker")
	}
}

func TestManualIdleEviction(t *testing.T) { synctest.Test(t, testManualIdleEviction) }

func testManualIdleEviction(t *testing.T) {
	ws := testWorkers(2)
	m := NewManual(PolicyOptions{MaxIdle: time.Hour, AssignmentMode: "min_group"})
	m.Select(ws, withHeaders(HeaderRoutingKey, "old"))
	time.Sleep(50 * time.Minute)
	m.Select(ws, withHeaders(HeaderRoutingKey, "fresh"))
	time.Sleep(20 * time.Minute)
	m.evictIdle()
	if _, ok := m.keys["old"]; ok {
		t.Fatal("idle key not evicted")
	}
	if _, ok := m.keys["fresh"]; !ok {
		t.Fatal("recent key evicted")
	}
	if len(m.groups) != 1 {
		t.Fatalf("group counts not released: %v", m.groups)
	}
}
