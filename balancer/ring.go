package balancer

import (
	"github.com/cespare/xxhash/v2"
	"slices"
	"strconv"
	"sync/atomic"
)

// hashRing places each worker at VirtualNodes points of a 64-bit ring, so a
// key keeps its worker while others come and go (only ~1/n of keys move).
type hashRing struct {
	workers []*Worker // the list it was built for (callers never modify it)
	points  []uint64  // sorted
	owners  []int32   // owners[i] indexes workers for points[i]
}

// ringCache rebuilds the ring only when the candidate list changes; in the
// steady state the router passes the same snapshot slice every time.
type ringCache struct {
	vnodes int
	cur    atomic.Pointer[hashRing]
}

func (c *ringCache) get(workers []*Worker) *hashRing {
	r := c.cur.Load()
	if r != nil && len(r.workers) == len(workers) && (&r.workers[0] == &workers[0] || slices.Equal(r.workers, workers)) {
		return r
	}
	r = newHashRing(workers, c.vnodes)
	c.cur.Store(r)
	return r
}

func newHashRing(workers []*Worker, vnodes int) *hashRing {
	type pt struct {
		h uint64
		o int32
	}
	pts := make([]pt, 0, len(workers)*vnodes)
	buf := make([]byte, 0, 128)
	for i, w := range workers {
		for v := range vnodes {
			buf = strconv.AppendInt(append(append(buf[:0], w.URL...), '#'), int64(v), 10)
			pts = append(pts, pt{xxhash.Sum64(buf), int32(i)})
		}
	}
	slices.SortFunc(pts, func(a, b pt) int {
		if a.h < b.h {
			return -1
		}
		if a.h > b.h {
			return 1
		}
		return int(a.o - b.o)
	})
	r := &hashRing{workers: workers, points: make([]uint64, len(pts)), owners: make([]int32, len(pts))}
	for i, p := range pts {
		r.points[i], r.owners[i] = p.h, p.o
	}
	return r
}

// first is the index of the first point clockwise from h.
func (r *hashRing) first(h uint64) int {
	i, _ := slices.BinarySearch(r.points, h)
	if i == len(r.points) {
		i = 0
	}
	return i
}

// lookup returns the worker owning key's position.
func (r *hashRing) lookup(h uint64) *Worker { return r.workers[r.owners[r.first(h)]] }

// xxhash: stable across restarts (so sticky keys survive a router
// restart), allocation-free and fast on long prefixes.
func hashString(s string) uint64 { return xxhash.Sum64String(s) }
