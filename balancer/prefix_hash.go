package balancer

import (
	"math"
	"math/rand/v2"
)

// PrefixHash hashes the first PrefixBytes bytes of the text onto a hash
// ring (consistent hashing with bounded loads). Upstream hashes the first
// 256 tokens, which over HTTP do not exist, so it never selects; bytes of
// text give the same affinity without a tokenizer. A worker whose load
// would exceed LoadFactor × the mean passes the request clockwise to the
// next one, so a hot prefix cannot swamp a single worker.
type PrefixHash struct {
	ring     ringCache
	prefix   int
	factor   float64
	branches branchCounters
}

func NewPrefixHash(o PolicyOptions) *PrefixHash {
	o = o.withDefaults()
	return &PrefixHash{ring: ringCache{vnodes: o.VirtualNodes}, prefix: o.PrefixBytes, factor: o.LoadFactor,
		branches: o.Metrics.branchCounters("prefix_hash", "no_text", "hash", "load_spill", "least_loaded")}
}

func (*PrefixHash) Name() string    { return "prefix_hash" }
func (*PrefixHash) NeedsText() bool { return true }

func (p *PrefixHash) Select(workers []*Worker, req *Request) (*Worker, error) {
	if req == nil || req.Text == "" {
		p.branches.inc("no_text")
		return workers[rand.IntN(len(workers))], nil
	}
	text := req.Text[:min(len(req.Text), p.prefix)]
	var total int64
	for _, w := range workers {
		total += w.Load()
	}
	limit := int64(math.Ceil(p.factor * float64(total+1) / float64(len(workers))))
	r := p.ring.get(workers)
	i := r.first(hashString(text))
	for step := range len(r.points) {
		if w := r.workers[r.owners[i]]; w.Load() < limit {
			if step == 0 {
				p.branches.inc("hash")
			} else {
				p.branches.inc("load_spill")
			}
			return w, nil
		}
		if i++; i == len(r.points) {
			i = 0
		}
	}
	p.branches.inc("least_loaded")
	return minBy(workers, (*Worker).Load), nil
}
