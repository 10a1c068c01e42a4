//go:build cgo

package ucx

import (
	"errors"
	"runtime"
	"sync"
	"sync/atomic"
	"time"
)

// idleSpins is how many idle iterations the loop spins before it sleeps
// on the event fd: sleeping costs a syscall and a wakeup of several µs.
const idleSpins = 2000

// Loop owns a Worker on a goroutine locked to its OS thread: it progresses
// the worker, runs submitted closures there, and sleeps on the worker's
// event fd when idle.
type Loop struct {
	w        *Worker
	poll     func(*Worker) bool
	mu       sync.Mutex
	queue    []func(*Worker)
	closing  bool // no more submissions; the loop exits when its queue is empty
	closed   bool // Close was called
	err      error
	sleeping atomic.Bool
	stopping chan struct{} // closed with closing
	done     chan error
}

// NewLoop starts a loop with a new worker of ctx.
func NewLoop(ctx *Context, cfg LoopConfig) (*Loop, error) {
	l := &Loop{poll: cfg.Poll, stopping: make(chan struct{}), done: make(chan error, 1)}
	started := make(chan error, 1)
	go l.run(ctx, cfg.Mode, started)
	if err := <-started; err != nil {
		return nil, err
	}
	return l, nil
}

// Submit queues fn to run on the loop goroutine; it returns ErrClosed once
// Close was called.
func (l *Loop) Submit(fn func(*Worker)) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closing {
		return ErrClosed
	}
	l.queue = append(l.queue, fn)
	if l.sleeping.Load() {
		return l.w.Signal()
	}
	return nil
}

// Do runs fn on the loop goroutine and returns its error.
func (l *Loop) Do(fn func(*Worker) error) error {
	res := make(chan error, 1)
	if err := l.Submit(func(w *Worker) { res <- fn(w) }); err != nil {
		return err
	}
	return <-res
}

// Done is closed once the loop accepts no more work: after Close, or when a
// worker error stopped it on its own (Err then says which). Owners watch it
// so that a dead worker fails loudly instead of failing every later call.
func (l *Loop) Done() <-chan struct{} { return l.stopping }

// Err returns the worker error that stopped the loop, nil if none did.
func (l *Loop) Err() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.err
}

// stopLocked stops accepting work; l.mu is held.
func (l *Loop) stopLocked() {
	if !l.closing {
		l.closing = true
		close(l.stopping)
	}
}

// Close runs the closures already queued, closes the worker (with its
// endpoints and listeners) and stops the goroutine.
func (l *Loop) Close() error {
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return ErrClosed
	}
	l.closed = true
	l.stopLocked()
	if l.sleeping.Load() {
		l.w.Signal()
	}
	l.mu.Unlock()
	return <-l.done
}

func (l *Loop) run(ctx *Context, mode ThreadMode, started chan<- error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	w, err := ctx.NewWorker(mode)
	if err != nil {
		started <- err
		return
	}
	l.w = w
	started <- nil
	idle := 0
	var batch []func(*Worker)
	for {
		active := w.Progress()
		l.mu.Lock()
		batch, l.queue = l.queue, batch[:0]
		closing := l.closing
		l.mu.Unlock()
		for i, fn := range batch {
			fn(w)
			batch[i] = nil
		}
		if len(batch) > 0 {
			active = true
		}
		if l.poll != nil && l.poll(w) {
			active = true
		}
		if closing && len(batch) == 0 {
			l.done <- errors.Join(l.err, w.Close())
			return
		}
		if active {
			idle = 0
			continue
		}
		if idle++; idle < idleSpins {
			continue
		}
		idle = 0
		l.sleeping.Store(true)
		l.mu.Lock()
		pending := len(l.queue) > 0 || l.closing
		l.mu.Unlock()
		if !pending {
			// Bounded so a Poll hook with deadlines still gets called.
			err = w.WaitEvents(100 * time.Millisecond)
		}
		l.sleeping.Store(false)
		if err != nil {
			// Fatal for the loop: stop accepting work; Done, Err and
			// Close report it.
			l.mu.Lock()
			l.err = err
			l.stopLocked()
			l.mu.Unlock()
		}
	}
}
