package balancer

import (
	"slices"
	"sync"
	"sync/atomic"

	"github.com/google/uuid"
)

// Snapshot is an immutable view of the registered workers. The hot path
// loads it with one atomic read and never locks.
type Snapshot struct {
	All    []*Worker
	ByType [3][]*Worker // indexed by WorkerType
	byURL  map[string]*Worker
	byID   map[string]*Worker
	byBase map[string][]*Worker // an engine's workers: its DP ranks, or itself
}

func (s *Snapshot) ByURL(u string) *Worker { return s.byURL[u] }
func (s *Snapshot) ByID(id string) *Worker { return s.byID[id] }

// ByBaseURL returns the workers of the engine at base: one per DP rank
// with --dp-aware, else the one worker.
func (s *Snapshot) ByBaseURL(base string) []*Worker { return s.byBase[base] }

// Available returns the workers of a type that may take traffic now:
// healthy, let in by their breakers, and not suspect unless all of those
// are, so every policy steers around a worker that stopped answering. It
// allocates only when some worker is left out.
func (s *Snapshot) Available(t WorkerType) []*Worker {
	ws := s.ByType[t]
	for i, w := range ws {
		if ok := w.Available(); !ok || w.Suspect() {
			return available(ws, i, ok)
		}
	}
	return ws
}

// available is Available's slow path: ws[:first] are in, ws[first] is out
// or, when firstOK, suspect. Each worker's Available is asked once: a
// half-open breaker offers its trial to one caller only.
func available(ws []*Worker, first int, firstOK bool) []*Worker {
	out := make([]*Worker, first, len(ws))
	copy(out, ws[:first])
	var suspects []*Worker
	if firstOK {
		suspects = append(suspects, ws[first])
	}
	for _, w := range ws[first+1:] {
		switch {
		case !w.Available():
		case w.Suspect():
			suspects = append(suspects, w)
		default:
			out = append(out, w)
		}
	}
	if len(out) == 0 {
		return suspects
	}
	return out
}

// Registry owns the set of workers. Writers serialise on a mutex and publish
// a fresh Snapshot.
type Registry struct {
	mu        sync.Mutex
	snap      atomic.Pointer[Snapshot]
	listeners []func(*Snapshot)
}

func NewRegistry() *Registry {
	r := &Registry{}
	r.snap.Store(buildSnapshot(nil))
	return r
}

func (r *Registry) Snapshot() *Snapshot { return r.snap.Load() }

// OnChange registers fn to be called with every new snapshot, in order,
// after it is published (policies keep per-worker state in step this way).
// fn runs under the registry's write lock: it must not call Add or Remove.
func (r *Registry) OnChange(fn func(*Snapshot)) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.listeners = append(r.listeners, fn)
	fn(r.snap.Load())
}

func (r *Registry) publish(all []*Worker) {
	s := buildSnapshot(all)
	r.snap.Store(s)
	for _, fn := range r.listeners {
		fn(s)
	}
}

// Add registers a worker, assigning an ID when it has none. Adding a URL that
// is already registered returns the existing worker and false.
func (r *Registry) Add(w *Worker) (*Worker, bool) {
	if old, ok := r.AddAll([]*Worker{w}); !ok {
		return old, false
	}
	return w, true
}

// AddAll registers an engine's workers (its DP ranks) in one snapshot, so
// that no request sees only some of them. If any URL is taken, nothing is
// added and the worker holding it is returned.
func (r *Registry) AddAll(ws []*Worker) (*Worker, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	cur := r.snap.Load()
	for _, w := range ws {
		if old := cur.byURL[w.URL]; old != nil {
			return old, false
		}
	}
	for _, w := range ws {
		if w.ID == "" {
			w.ID = uuid.NewString()
		}
	}
	r.publish(append(slices.Clone(cur.All), ws...))
	return nil, true
}

// Remove unregisters a worker by URL, or every DP rank of the engine whose
// base URL it is, returning them. In-flight requests keep their pointer and
// finish normally.
func (r *Registry) Remove(url string) ([]*Worker, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	cur := r.snap.Load()
	gone := cur.byBase[url]
	if w := cur.byURL[url]; w != nil {
		gone = []*Worker{w}
	}
	if len(gone) == 0 {
		return nil, false
	}
	r.publish(slices.DeleteFunc(slices.Clone(cur.All), func(x *Worker) bool { return slices.Contains(gone, x) }))
	return gone, true
}

// update publishes fn's copy of the registered worker with id, reading it
// under the write lock so concurrent updates build on each other.
func (r *Registry) update(id string, fn func(*Worker) *Worker) (*Worker, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	cur := r.snap.Load()
	i := slices.IndexFunc(cur.All, func(x *Worker) bool { return x.ID == id })
	if i < 0 {
		return nil, false
	}
	all := slices.Clone(cur.All)
	all[i] = fn(all[i])
	r.publish(all)
	return all[i], true
}

func buildSnapshot(all []*Worker) *Snapshot {
	s := &Snapshot{All: all, byURL: make(map[string]*Worker, len(all)), byID: make(map[string]*Worker, len(all)),
		byBase: make(map[string][]*Worker, len(all))}
	for _, w := range all {
		s.ByType[w.Type] = append(s.ByType[w.Type], w)
		s.byURL[w.URL] = w
		s.byID[w.ID] = w
		s.byBase[w.BaseURL] = append(s.byBase[w.BaseURL], w)
	}
	return s
}
