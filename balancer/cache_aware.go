package balancer

import (
	"context"
	"maps"
	"slices"
	"sync"
	"sync/atomic"
)

// CacheAware sends a request to the worker that most likely holds its
// prefix in cache (spec §4.4), unless the pool is imbalanced:
//  1. imbalanced iff max−min load > BalanceAbsThreshold and max > min × BalanceRelThreshold:
//     take the least-loaded worker;
//  2. else if the longest cached prefix covers > CacheThreshold of the text: the
//     least-loaded worker among those that were sent that prefix;
//  3. else (a miss) the least-loaded worker, ties rotated so a burst of misses
//     spreads instead of piling onto one worker;
//
// and records the text under the chosen worker. Loads are in-flight counts.
// One tree per model, each bounded in bytes by MaxTreeSize; removed
// workers are swept out every EvictionInterval (Run).
type CacheAware struct {
	opts     PolicyOptions
	branches branchCounters
	rot      atomic.Uint64 // rotates ties between least-loaded workers

	trees atomic.Pointer[map[string]*cacheTree] // copy on write; one per model
	newMu sync.Mutex                            // serialises tree creation

	mu   sync.Mutex // guards the tenant table
	ids  map[string]uint32
	urls []string // by tenant id; "" when free
	free []uint32 // ids forgotten by sweep, reused first: the table is as big as the most workers seen at once
	dead map[uint32]bool
}

type cacheTree struct {
	mu   sync.Mutex
	tree *radixTree
	cand candidates // for the last candidate list seen
}

// candidates maps a candidate list to tenant ids and back.
type candidates struct {
	workers []*Worker
	ids     []uint32 // ids[i] is workers[i]'s tenant id
	pos     []int32  // pos[id] is 1 + index in workers, 0 when absent
}

func NewCacheAware(o PolicyOptions) *CacheAware {
	o = o.withDefaults()
	c := &CacheAware{opts: o, branches: o.Metrics.branchCounters("cache_aware", "balance", "hit", "miss"), ids: map[string]uint32{}, dead: map[uint32]bool{}}
	c.trees.Store(&map[string]*cacheTree{})
	return c
}

func (*CacheAware) Name() string    { return "cache_aware" }
func (*CacheAware) NeedsText() bool { return true }

func (c *CacheAware) Select(workers []*Worker, req *Request) (*Worker, error) {
	var text, model string
	if req != nil {
		text, model = req.Text, servedModel(workers, req.Model)
	}
	minL, maxL, ties := loadStats(workers)
	t := c.tree(model)
	t.mu.Lock()
	defer t.mu.Unlock()
	cand := t.candidates(c, workers)
	var pick int
	switch {
	case maxL-minL > c.opts.BalanceAbsThreshold && float64(maxL) > float64(minL)*c.opts.BalanceRelThreshold:
		pick = c.leastLoaded(workers, minL, ties)
		c.branches.inc("balance")
	default:
		pick = -1
		if matched, n := t.tree.match(text); len(text) > 0 && float64(matched)/float64(len(text)) > c.opts.CacheThreshold {
			pick = cand.bestTenant(workers, n.tenants)
		}
		if pick >= 0 {
			c.branches.inc("hit")
		} else {
			pick = c.leastLoaded(workers, minL, ties)
			c.branches.inc("miss")
		}
	}
	if text != "" {
		t.tree.insert(text, cand.ids[pick])
	}
	return workers[pick], nil
}

// servedModel is model if a candidate serves it, else "" (the default
// tree): the name is client input, and a tree per name sent would grow
// without bound.
func servedModel(workers []*Worker, model string) string {
	if model == "" {
		return ""
	}
	for _, w := range workers {
		if w.ModelID == model {
			return model
		}
	}
	return ""
}

// loadStats returns the min load, how many have it, and the max load.
// Loads move under concurrent requests, so each is read once: a second
// read of the first worker's could exceed the min taken from the first
// and leave no worker counted at it (ties 0, a division by zero).
func loadStats(workers []*Worker) (lo, hi int64, ties int) {
	for i, w := range workers {
		l := w.Load()
		switch {
		case i == 0 || l < lo:
			lo, ties = l, 1
		case l == lo:
			ties++
		}
		if i == 0 || l > hi {
			hi = l
		}
	}
	return lo, hi, ties
}

// leastLoaded picks, in rotation, one of the workers at the minimum load.
func (c *CacheAware) leastLoaded(workers []*Worker, lo int64, ties int) int {
	k := int(c.rot.Add(1) % uint64(ties))
	best, bestLoad := 0, workers[0].Load()
	for i, w := range workers {
		l := w.Load()
		if l <= lo {
			if k == 0 {
				return i
			}
			k--
		}
		if l < bestLoad {
			best, bestLoad = i, l
		}
	}
	return best // loads moved under us: take the current minimum
}

// bestTenant is the least-loaded candidate among tenants, or -1.
func (cd *candidates) bestTenant(workers []*Worker, tenants []uint32) int {
	best, bestLoad := -1, int64(0)
	for _, id := range tenants {
		if int(id) >= len(cd.pos) || cd.pos[id] == 0 {
			continue
		}
		i := int(cd.pos[id] - 1)
		if l := workers[i].Load(); best < 0 || l < bestLoad {
			best, bestLoad = i, l
		}
	}
	return best
}

// candidates returns the id mapping for workers, rebuilding it when the
// list differs from the last one (in the steady state it is the same
// snapshot slice). Caller holds t.mu.
func (t *cacheTree) candidates(c *CacheAware, workers []*Worker) *candidates {
	cd := &t.cand
	if len(cd.workers) == len(workers) && (&cd.workers[0] == &workers[0] || slices.Equal(cd.workers, workers)) {
		return cd
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	cd.workers = workers
	cd.ids = cd.ids[:0]
	for _, w := range workers {
		id, ok := c.ids[w.URL]
		if !ok {
			id = c.newTenant(w.URL)
		}
		delete(c.dead, id) // re-added before the sweep: keep its entries
		cd.ids = append(cd.ids, id)
	}
	cd.pos = make([]int32, len(c.urls))
	for i, id := range cd.ids {
		cd.pos[id] = int32(i + 1)
	}
	return cd
}

// newTenant gives url an id, a freed one if any. Caller holds c.mu.
func (c *CacheAware) newTenant(url string) uint32 {
	var id uint32
	if n := len(c.free); n > 0 {
		id, c.free = c.free[n-1], c.free[:n-1]
		c.urls[id] = url
	} else {
		id = uint32(len(c.urls))
		c.urls = append(c.urls, url)
	}
	c.ids[url] = id
	return id
}

func (c *CacheAware) tree(model string) *cacheTree {
	if t := (*c.trees.Load())[model]; t != nil {
		return t
	}
	c.newMu.Lock()
	defer c.newMu.Unlock()
	old := *c.trees.Load()
	if t := old[model]; t != nil {
		return t
	}
	t := &cacheTree{tree: newRadixTree(c.opts.MaxTreeSize)}
	next := maps.Clone(old)
	next[model] = t
	c.trees.Store(&next)
	return t
}

// WorkersChanged marks tenants that left the registry for the next sweep.
func (c *CacheAware) WorkersChanged(s *Snapshot) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for url, id := range c.ids {
		if s.ByURL(url) == nil {
			c.dead[id] = true
		}
	}
}

// Run sweeps removed workers out of the trees every EvictionInterval.
func (c *CacheAware) Run(ctx context.Context) { runEvery(ctx, c.opts.EvictionInterval, c.sweep) }

func (c *CacheAware) sweep() {
	c.mu.Lock()
	dead := maps.Clone(c.dead)
	c.mu.Unlock()
	if len(dead) == 0 {
		return
	}
	for _, t := range *c.trees.Load() {
		t.mu.Lock()
		t.tree.dropTenants(dead)
		t.mu.Unlock()
	}
	c.mu.Lock()
	for id := range dead {
		if c.dead[id] { // still gone: forget the URL (a later return gets a new id)
			delete(c.ids, c.urls[id])
			delete(c.dead, id)
			c.urls[id] = ""
			c.free = append(c.free, id)
		}
	}
	c.mu.Unlock()
}

// TreeBytes is the estimated memory of all trees (for tests and metrics).
func (c *CacheAware) TreeBytes() int64 {
	var n int64
	for _, t := range *c.trees.Load() {
		t.mu.Lock()
		n += t.tree.bytes
		t.mu.Unlock()
	}
	return n
}
