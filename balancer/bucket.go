package balancer

import (
	"context"
	"math"
	"math/rand/v2"
	"slices"
	"sync"
	"time"
)

// Bucket (PD prefill only, spec §4.5) gives each worker a range of request
// lengths, recomputed every BucketAdjustInterval from recent lengths so
// each range carries an equal share of characters; short and long prompts
// then land on different prefill workers. If the characters routed since
// the last adjustment are imbalanced (the abs/rel test of cache_aware), the
// worker with the fewest takes the request; with no ranges yet, random.
type Bucket struct {
	absT float64
	relT float64
	tick time.Duration

	mu      sync.Mutex
	slots   map[string]int // per-URL index into chars
	free    []int          // slots of removed workers, reused first
	chars   []int64        // characters routed per slot since the last adjustment
	cand    []*Worker      // last candidate list and its slots, reused while unchanged
	candIdx []int
	recent  []int // ring of recent lengths
	next    int
	workers int   // pool size seen last, the number of ranges to cut
	bounds  []int // bounds[i]: longest length for worker i
}

const bucketHistory = 4096

func NewBucket(o PolicyOptions) *Bucket {
	o = o.withDefaults()
	return &Bucket{absT: float64(o.BalanceAbsThreshold), relT: o.BalanceRelThreshold, tick: o.BucketAdjustInterval,
		slots: map[string]int{}, recent: make([]int, 0, bucketHistory)}
}

func (*Bucket) Name() string    { return "bucket" }
func (*Bucket) NeedsText() bool { return true }

func (b *Bucket) Select(workers []*Worker, req *Request) (*Worker, error) {
	n := 0
	if req != nil {
		n = len(req.Text)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.workers = len(workers)
	idx := b.slotsFor(workers)
	i := b.pick(workers, idx, n)
	b.chars[idx[i]] += int64(n)
	if len(b.recent) < bucketHistory {
		b.recent = append(b.recent, n)
	} else {
		b.recent[b.next] = n
		b.next = (b.next + 1) % bucketHistory
	}
	return workers[i], nil
}

// slotsFor maps workers to their chars slots. Caller holds mu.
func (b *Bucket) slotsFor(workers []*Worker) []int {
	if len(b.cand) == len(workers) && (&b.cand[0] == &workers[0] || slices.Equal(b.cand, workers)) {
		return b.candIdx
	}
	b.cand, b.candIdx = workers, make([]int, len(workers))
	for i, w := range workers {
		s, ok := b.slots[w.URL]
		if !ok {
			if n := len(b.free); n > 0 {
				s, b.free = b.free[n-1], b.free[:n-1]
				b.chars[s] = 0
			} else {
				s = len(b.chars)
				b.chars = append(b.chars, 0)
			}
			b.slots[w.URL] = s
		}
		b.candIdx[i] = s
	}
	return b.candIdx
}

// WorkersChanged frees the slots of workers that left the registry, so
// slots do not grow with every URL ever seen.
func (b *Bucket) WorkersChanged(s *Snapshot) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for url, slot := range b.slots {
		if s.ByURL(url) == nil {
			delete(b.slots, url)
			b.free = append(b.free, slot)
			b.cand = nil // its slots may be reused
		}
	}
}

func (b *Bucket) pick(workers []*Worker, idx []int, n int) int {
	lo, hi := int64(math.MaxInt64), int64(0)
	least := 0
	for i, s := range idx {
		c := b.chars[s]
		if c < lo {
			lo, least = c, i
		}
		if c > hi {
			hi = c
		}
	}
	if float64(hi-lo) > b.absT && float64(hi) > float64(lo)*b.relT {
		return least
	}
	if len(b.bounds) != len(workers) {
		return rand.IntN(len(workers))
	}
	i, _ := slices.BinarySearch(b.bounds, n)
	return min(i, len(workers)-1)
}

// Run recomputes the ranges every BucketAdjustInterval.
func (b *Bucket) Run(ctx context.Context) { runEvery(ctx, b.tick, b.adjust) }

// adjust cuts the recent lengths into ranges of equal character mass.
func (b *Bucket) adjust() {
	b.mu.Lock()
	defer b.mu.Unlock()
	clear(b.chars)
	if b.workers == 0 || len(b.recent) == 0 {
		return
	}
	ls := slices.Clone(b.recent)
	slices.Sort(ls)
	var total int
	for _, l := range ls {
		total += l
	}
	bounds := make([]int, 0, b.workers)
	acc, k := 0, 1
	for _, l := range ls {
		acc += l
		for k < b.workers && acc*b.workers >= total*k {
			bounds = append(bounds, l)
			k++
		}
	}
	for len(bounds) < b.workers {
		bounds = append(bounds, math.MaxInt)
	}
	bounds[len(bounds)-1] = math.MaxInt
	b.bounds = bounds
}
