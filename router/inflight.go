package router

import (
	"container/list"
	"sync"
	"time"
)

// inflight tracks every request in progress so that one sweeper goroutine
// does what would otherwise take two runtime timers and a child of a shared
// context per request: it starts the disconnect watch of requests older
// than watchDelay, ends those past --request-timeout-secs, and cancels all
// of them at hard shutdown. Per-request timers are not cheap here: arming
// the earliest one wakes the netpoller's thread, so every short request
// paid for a thread wakeup, and registering each context under one parent
// serialised all requests on the parent's lock.
//
// A request enters the young queue (start order). Once it is watchDelay
// old, the sweeper drops it if it has ended, or starts its watch and moves
// it to the long list, whose head is always the next to time out. The
// sweeper ticks every sweepTick while anything is in flight and sleeps
// otherwise.
type inflight struct {
	timeout time.Duration

	mu        sync.Mutex
	young     []*request // queued in start order; ended ones are dropped lazily
	youngHead int
	long      list.List // of *request, oldest first
	closed    bool      // after shutdown every new request starts cancelled
	idle      bool      // the sweeper waits for kick
	kick      chan struct{}
	stop      chan struct{}
	done      chan struct{}

	watcher watcher // the disconnect watches (connwatch.go)
}

// tracking is what the tracker keeps in each request, under its lock.
type tracking struct {
	watch     connWatch     // started once the request is watchDelay old
	watching  bool          // watch was started
	responded bool          // the response is complete: no watch may start
	released  bool          // the last reference is gone
	long      *list.Element // its place in the long list, if there
}

const (
	// sweepTick is finer than watchDelay needs, but coarser ticks measured
	// no better: at 5 ms the runtime's idle threads slept and woke twice as
	// often (nanosleep calls per request 0.45 -> 0.91 at 3,200 req/s); at
	// 10 ms CPU and TTFT moved within the noise (bench/RESULTS.md).
	sweepTick = time.Millisecond
	// sweepIdleTicks of nothing in flight put the sweeper to sleep; under
	// steady traffic it then keeps its ticker rather than being woken for
	// every request.
	sweepIdleTicks = 100
)

func newInflight(timeout time.Duration) *inflight {
	f := &inflight{timeout: timeout, idle: true, kick: make(chan struct{}, 1),
		stop: make(chan struct{}), done: make(chan struct{})}
	go f.run()
	return f
}

// add tracks r from now until its last reference is released.
func (f *inflight) add(r *request) {
	f.mu.Lock()
	if f.closed {
		f.mu.Unlock()
		r.cancel(errShuttingDown)
		return
	}
	f.young = append(f.young, r)
	wake := f.idle
	f.idle = false
	f.mu.Unlock()
	if wake {
		select {
		case f.kick <- struct{}{}:
		default:
		}
	}
}

// finished marks r's response as complete: no watch may start any more,
// and one that was started is stopped (reported by the result).
func (f *inflight) finished(r *request) bool {
	f.mu.Lock()
	r.track.responded = true
	watching := r.track.watching
	f.mu.Unlock()
	if watching {
		r.track.watch.stop()
	}
	return watching
}

// remove stops tracking r (its last reference is gone).
func (f *inflight) remove(r *request) {
	f.mu.Lock()
	r.track.released = true
	f.unlinkLocked(r)
	f.mu.Unlock()
}

func (f *inflight) unlinkLocked(r *request) {
	if r.track.long != nil {
		f.long.Remove(r.track.long)
		r.track.long = nil
	}
}

func (f *inflight) emptyLocked() bool { return f.long.Len() == 0 && len(f.young) == f.youngHead }

func (f *inflight) run() {
	defer close(f.done)
	ticker := time.NewTicker(sweepTick)
	ticker.Stop()
	quiet := 0
	for {
		select {
		case <-f.stop:
			ticker.Stop()
			return
		case <-f.kick:
			ticker.Reset(sweepTick)
			quiet = 0
			continue
		case now := <-ticker.C:
			if f.sweep(now) {
				quiet = 0
			} else if quiet++; quiet >= sweepIdleTicks {
				f.mu.Lock()
				if f.emptyLocked() {
					f.idle = true
					ticker.Stop()
				}
				f.mu.Unlock()
			}
		}
	}
}

// sweep promotes young requests, starts their watches and times out the
// oldest; it reports whether anything was in flight.
func (f *inflight) sweep(now time.Time) bool {
	var expired []*request
	f.mu.Lock()
	busy := !f.emptyLocked()
	for f.youngHead < len(f.young) {
		r := f.young[f.youngHead]
		if now.Sub(r.start) < watchDelay {
			break
		}
		f.young[f.youngHead] = nil
		f.youngHead++
		if r.track.released {
			continue
		}
		if !r.track.responded && r.conn != nil {
			r.track.watching = f.watcher.start(&r.track.watch, r.conn, r.clientLeft)
		}
		r.track.long = f.long.PushBack(r)
	}
	// Under steady traffic the queue never drains: move what is left to the
	// front once the consumed part is the larger half.
	if f.youngHead > 0 && f.youngHead*2 >= len(f.young) {
		n := copy(f.young, f.young[f.youngHead:])
		clear(f.young[n:])
		f.young, f.youngHead = f.young[:n], 0
	}
	for e := f.long.Front(); f.timeout > 0 && e != nil; e = f.long.Front() {
		r := e.Value.(*request)
		if now.Sub(r.start) < f.timeout {
			break
		}
		f.unlinkLocked(r)
		expired = append(expired, r)
	}
	f.mu.Unlock()
	for _, r := range expired {
		r.cancel(errRequestTimeout)
	}
	return busy
}

// close cancels every request still in flight and stops the sweeper.
func (f *inflight) close() {
	f.mu.Lock()
	if f.closed {
		f.mu.Unlock()
		return
	}
	f.closed = true
	var all []*request
	for _, r := range f.young[f.youngHead:] {
		if !r.track.released {
			all = append(all, r)
		}
	}
	for e := f.long.Front(); e != nil; e = e.Next() {
		all = append(all, e.Value.(*request))
	}
	f.mu.Unlock()
	for _, r := range all {
		r.cancel(errShuttingDown)
	}
	close(f.stop)
	<-f.done
	f.watcher.close()
}
