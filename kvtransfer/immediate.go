package kvtransfer

import (
	"slices"
	"time"

	"github.com/pdrouter/pdrouter/kvtransfer/wire"
)

// Bounds of the writes Start takes: a copy this small, into the peer's
// mapping (shm) or the link's socket (tcp), takes less than handing the
// call to another goroutine.
const (
	startMax     = 64 << 10
	startTriples = 64
)

// Start begins a small write of ts to peer without waiting, if it can,
// and reports whether it did. It takes host memory into host memory the
// table of the link to peer (which must be up) lists, at most
// startTriples ranges and startMax bytes: over shm it copies and calls
// done before it returns; over tcp it sends the DATA frames and their
// fence from the caller, and the link's reader calls done with the
// answer, no goroutine between (or the link's failure calls it, or the
// watchdog once the write timeout passed). done runs once with what Write
// would return and must not block. False (nothing sent, done never runs):
// the write may wait (a GPU end, a destination only a table refresh would
// find, another write sending on the link): call Write.
func (s *MemorySession) Start(peer string, ts []Triple, done func(error)) bool {
	p := s.p
	if len(ts) == 0 || len(ts) > startTriples || p.gpu.holds(ts) {
		return false
	}
	var n uint64
	for _, t := range ts {
		if t.Len > startMax-n {
			return false
		}
		n += t.Len
	}
	p.mu.Lock()
	l := p.byAddr[peer]
	p.mu.Unlock()
	if l == nil {
		return false
	}
	runs, srcs, err := p.resolve(nil, l, ts)
	for _, r := range srcs {
		defer r.use.RUnlock()
	}
	if err != nil || slices.ContainsFunc(runs, func(r memRun) bool { return r.dst.Kind != wire.MemHost }) {
		return false
	}
	finish := func(err error) {
		if err == nil {
			p.m.written.Add(float64(n))
		}
		done(s.outcome(peer, err))
	}
	switch path := l.hostPath(); {
	case path == PathSHM && !slices.ContainsFunc(runs, needsRing):
		err := l.hostReachable(runs)
		if err == nil {
			err = l.putRMA(s.ctx, runs)
		}
		finish(err)
		return true
	case path == PathTCP:
		return l.startTCP(runs, time.Now().Add(writeDeadline(p.cfg.WriteTimeout, ts)), finish)
	}
	return false
}
