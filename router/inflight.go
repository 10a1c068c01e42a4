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
// sweeper sleeps until the oldest young request still in flight turns
// watchDelay old or the long list's head times out, whichever comes
// first, but at least sweepTick: under steady short requests (each ended
// long before watchDelay) it wakes about once per watchDelay, not once per
// tick (a wakeup per 30 requests at 30,000 req/s), and with nothing in
// flight not at all.
type inflight struct {
	timeout time.Duration

	mu        sync.Mutex
	young     []*request // queued in start order; nil where one ended
	youngHead int
	youngBase int       // the queue position of young[0]
	long      list.List // of *request, oldest first
	closed    bool      // after shutdown every new request starts cancelled
	idle      bool      // no sweep is due for a young request: add kicks the sweeper
	sweeps    int       // sweeps run (tests count the sweeper's wakeups)
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
	youngAt   int           // its position in the young queue (youngBase counts)
}

// sweepTick is the shortest sleep between sweeps: requests that turn
// watchDelay old (or time out) within it share one sweep.
const sweepTick = time.Millisecond

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
	r.track.youngAt = f.youngBase + len(f.young)
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

// remove stops tracking r (its last reference is gone). A young request
// leaves its queue at once: the sweeper may not pass for watchDelay, and
// the queue would keep that much garbage live (2.5 MB at 30,000 req/s).
func (f *inflight) remove(r *request) {
	f.mu.Lock()
	r.track.released = true
	if i := r.track.youngAt - f.youngBase; i >= f.youngHead && i < len(f.young) && f.young[i] == r {
		f.young[i] = nil
	}
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
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	for {
		select {
		case <-f.stop:
			timer.Stop()
			return
		case <-f.kick:
		case <-timer.C:
		}
		now := time.Now()
		if next, due := f.sweep(now); due {
			timer.Reset(max(next.Sub(now), sweepTick))
		}
	}
}

// sweep promotes young requests, starts their watches and times out the
// oldest. It returns when the next sweep is due; none when nothing in
// flight will need one.
func (f *inflight) sweep(now time.Time) (next time.Time, due bool) {
	var expired []*request
	f.mu.Lock()
	f.sweeps++
	for f.youngHead < len(f.young) {
		r := f.young[f.youngHead]
		if r != nil {
			if now.Sub(r.start) < watchDelay {
				next, due = r.start.Add(watchDelay), true
				break
			}
			if !r.track.responded && r.conn != nil {
				r.track.watching = f.watcher.start(&r.track.watch, r.conn, r.clientLeft)
			}
			r.track.long = f.long.PushBack(r)
		}
		f.young[f.youngHead] = nil
		f.youngHead++
	}
	// A later request's watchDelay ends after this one's; a sweep due only
	// for a timeout may come after it.
	f.idle = !due
	// Under steady traffic the queue never drains: move what is left to the
	// front once the consumed part is the larger half.
	if f.youngHead > 0 && f.youngHead*2 >= len(f.young) {
		n := copy(f.young, f.young[f.youngHead:])
		clear(f.young[n:])
		f.youngBase += f.youngHead
		f.young, f.youngHead = f.young[:n], 0
	}
	for e := f.long.Front(); f.timeout > 0 && e != nil; e = f.long.Front() {
		r := e.Value.(*request)
		if now.Sub(r.start) < f.timeout {
			if end := r.start.Add(f.timeout); !due || end.Before(next) {
				next, due = end, true
			}
			break
		}
		f.unlinkLocked(r)
		r.pin() // still tracked, so its life has not ended: it may end during the cancel
		expired = append(expired, r)
	}
	f.mu.Unlock()
	for _, r := range expired {
		r.cancel(errRequestTimeout)
		r.unpin()
	}
	return next, due
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
		if r != nil {
			all = append(all, r)
		}
	}
	for e := f.long.Front(); e != nil; e = e.Next() {
		all = append(all, e.Value.(*request))
	}
	for _, r := range all {
		r.pin() // as sweep's
	}
	f.mu.Unlock()
	for _, r := range all {
		r.cancel(errShuttingDown)
		r.unpin()
	}
	close(f.stop)
	<-f.done
	f.watcher.close()
}
