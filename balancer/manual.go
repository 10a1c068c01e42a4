package balancer

import (
	"context"
	"math/rand/v2"
	"slices"
	"sync"
	"time"
)

// Manual keeps sessions sticky by X-SMG-Routing-Key (spec §4.6): a key
// remembers up to two workers (the current one and its predecessor); a new
// key, or one whose workers are all gone, is assigned by AssignmentMode
// (random, min_load: fewest in-flight requests, min_group: fewest keys).
// Requests without a key go to a random worker. Keys idle for MaxIdle are
// evicted by Run.
type Manual struct {
	mode     string
	maxIdle  time.Duration
	metrics  *Metrics
	branches branchCounters

	mu     sync.Mutex
	keys   map[string]*manualEntry
	groups map[string]int // keys whose current worker is the URL, for min_group
}

type manualEntry struct {
	urls [2]string // urls[0] current, urls[1] previous
	cur  *Worker   // urls[0]'s worker when assigned: a pointer scan is cheaper than URLs
	last time.Time
}

func NewManual(o PolicyOptions) *Manual {
	o = o.withDefaults()
	return &Manual{mode: o.AssignmentMode, maxIdle: o.MaxIdle, metrics: o.Metrics,
		branches: o.Metrics.branchCounters("manual", "no_routing_key", "hit", "new_key", "reassigned"),
		keys:     map[string]*manualEntry{}, groups: map[string]int{}}
}

func (*Manual) Name() string    { return "manual" }
func (*Manual) NeedsText() bool { return false }

func (m *Manual) Select(workers []*Worker, req *Request) (*Worker, error) {
	key := req.header(HeaderRoutingKey)
	if key == "" {
		m.branches.inc("no_routing_key")
		return workers[rand.IntN(len(workers))], nil
	}
	now := time.Now()
	m.mu.Lock()
	defer m.mu.Unlock()
	e := m.keys[key]
	if e != nil {
		e.last = now
		if slices.Contains(workers, e.cur) {
			m.branches.inc("hit")
			return e.cur, nil
		}
		for _, u := range e.urls {
			if w := findURL(workers, u); w != nil {
				m.branches.inc("hit")
				return w, nil
			}
		}
	}
	w := m.assign(workers)
	if e == nil {
		e = &manualEntry{last: now}
		m.keys[key] = e
		m.branches.inc("new_key")
		m.metrics.setManualEntries(len(m.keys))
	} else {
		m.branches.inc("reassigned")
		m.ungroup(e.urls[0])
	}
	e.urls[0], e.urls[1], e.cur = w.URL, e.urls[0], w
	m.groups[w.URL]++
	return w, nil
}

// assign picks a worker for a key by the assignment mode. Caller holds mu.
func (m *Manual) assign(workers []*Worker) *Worker {
	switch m.mode {
	case "min_load":
		return minBy(workers, func(w *Worker) int64 { return w.Load() })
	case "min_group":
		return minBy(workers, func(w *Worker) int64 { return int64(m.groups[w.URL]) })
	}
	return workers[rand.IntN(len(workers))]
}

// minBy returns a worker with the smallest f, ties broken at random.
func minBy(workers []*Worker, f func(*Worker) int64) *Worker {
	var best *Worker
	var bestV int64
	ties := 0
	for _, w := range workers {
		switch v := f(w); {
		case best == nil || v < bestV:
			best, bestV, ties = w, v, 1
		case v == bestV:
			ties++
			if rand.IntN(ties) == 0 { // reservoir sampling over the ties
				best = w
			}
		}
	}
	return best
}

func (m *Manual) ungroup(url string) {
	if m.groups[url]--; m.groups[url] <= 0 {
		delete(m.groups, url)
	}
}

func findURL(workers []*Worker, url string) *Worker {
	if url == "" {
		return nil
	}
	for _, w := range workers {
		if w.URL == url {
			return w
		}
	}
	return nil
}

// Run evicts keys idle for longer than MaxIdle.
func (m *Manual) Run(ctx context.Context) { runEvery(ctx, max(m.maxIdle/8, time.Second), m.evictIdle) }

func (m *Manual) evictIdle() {
	cutoff := time.Now().Add(-m.maxIdle)
	m.mu.Lock()
	defer m.mu.Unlock()
	for k, e := range m.keys {
		if e.last.Before(cutoff) {
			delete(m.keys, k)
			m.ungroup(e.urls[0])
		}
	}
	m.metrics.setManualEntries(len(m.keys))
}
