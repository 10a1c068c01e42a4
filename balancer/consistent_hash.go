package balancer

import (
	"math/rand/v2"
	"strconv"
)

// ConsistentHashing routes by key on a hash ring (spec §4.6):
// X-SMG-Target-Worker pins an index of the available list (Request.target); otherwise
// X-SMG-Routing-Key, else an implicit key (authorization, x-forwarded-for,
// cookie) picks a ring position; with no key at all, random.
type ConsistentHashing struct {
	ring     ringCache
	branches branchCounters
}

func NewConsistentHashing(o PolicyOptions) *ConsistentHashing {
	o = o.withDefaults()
	return &ConsistentHashing{ring: ringCache{vnodes: o.VirtualNodes},
		branches: o.Metrics.branchCounters("consistent_hashing", "target_worker", "target_worker_miss", "routing_key", "implicit_key", "random")}
}

// Headers read by key-based policies.
const (
	HeaderTargetWorker = "X-SMG-Target-Worker"
	HeaderRoutingKey   = "X-SMG-Routing-Key"
)

var implicitKeyHeaders = []string{"Authorization", "X-Forwarded-For", "Cookie"}

func (*ConsistentHashing) Name() string    { return "consistent_hashing" }
func (*ConsistentHashing) NeedsText() bool { return false }

func (c *ConsistentHashing) Select(workers []*Worker, req *Request) (*Worker, error) {
	if t := req.header(HeaderTargetWorker); t != "" {
		var w *Worker
		if i, err := strconv.Atoi(t); err == nil {
			w = req.target(workers, i)
		}
		if w == nil {
			c.branches.inc("target_worker_miss")
			return nil, ErrNoSelection
		}
		c.branches.inc("target_worker")
		return w, nil
	}
	branch, key := "routing_key", req.header(HeaderRoutingKey)
	for _, h := range implicitKeyHeaders {
		if key != "" {
			break
		}
		branch, key = "implicit_key", req.header(h)
	}
	if key == "" {
		c.branches.inc("random")
		return workers[rand.IntN(len(workers))], nil
	}
	c.branches.inc(branch)
	return c.ring.get(workers).lookup(hashString(key)), nil
}
