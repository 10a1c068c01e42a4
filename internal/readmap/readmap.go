// Package readmap is a concurrent map for keys read on every request and
// added almost never, such as the resolved children of labelled metrics.
package readmap

import (
	"maps"
	"sync"
	"sync/atomic"
)

// Map is safe for concurrent use; the zero value is an empty map.
//
// A read is one atomic load and a lookup in an immutable Go map, whose key
// hashes with its own type's hash function. sync.Map hashes every key
// through its interface (runtime.nilinterhash), which was two thirds of
// each lookup, and the router made four such lookups per request. An add
// copies the map, so the key set must stay small and bounded.
type Map[K comparable, V any] struct {
	m  atomic.Pointer[map[K]V]
	mu sync.Mutex // serialises adds
}

// Load returns k's value, if it has one.
func (m *Map[K, V]) Load(k K) (V, bool) {
	if p := m.m.Load(); p != nil {
		v, ok := (*p)[k]
		return v, ok
	}
	var zero V
	return zero, false
}

// LoadOrStore returns k's value, storing v as that value first if k has
// none.
func (m *Map[K, V]) LoadOrStore(k K, v V) V {
	m.mu.Lock()
	defer m.mu.Unlock()
	var next map[K]V
	if p := m.m.Load(); p != nil {
		if cur, ok := (*p)[k]; ok {
			return cur
		}
		next = make(map[K]V, len(*p)+1)
		maps.Copy(next, *p)
	} else {
		next = make(map[K]V, 1)
	}
	next[k] = v
	m.m.Store(&next)
	return v
}
