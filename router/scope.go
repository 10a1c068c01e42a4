package router

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"
)

// scope is the context of a request and of each PD attempt within it. It
// does what context.WithCancelCause plus context.AfterFunc did for them,
// without their per-request allocations (a cancelCtx, a cause closure, an
// afterFuncCtx, two more closures, the parent's child map and its Done
// channel): it is embedded in the request, registers what must hear of a
// cancellation (upstream connections, child scopes) in inline slots, and
// makes its Done channel only for the few callers that select on it.
type scope struct {
	mu sync.Mutex
	// ended is set once cause is: Cause, called about eight times per
	// request, reads a live scope's without taking mu.
	ended atomic.Bool
	cause error
	done  chan struct{}
	hooks [3]canceller
	more  *[]canceller // past hooks' slots: rare, and 16 bytes less in every request and attempt
}

// canceller is told once when the scope it is registered with ends.
type canceller interface {
	cancelled(cause error)
}

// inherit makes s a child of parent: it ends with it. A zero scope is a root.
func (s *scope) inherit(parent *scope) {
	if !parent.register(s) {
		s.endLocked(parent.Cause()) // s is not shared yet
	}
}

// cancel ends the scope with cause; only the first call counts.
func (s *scope) cancel(cause error) {
	s.mu.Lock()
	if s.cause != nil {
		s.mu.Unlock()
		return
	}
	s.endLocked(cause)
	if s.done != nil {
		close(s.done)
	}
	hooks, more := s.hooks, s.more
	s.hooks, s.more = [3]canceller{}, nil
	s.mu.Unlock()
	for _, h := range hooks {
		if h != nil {
			h.cancelled(cause)
		}
	}
	if more != nil {
		for _, h := range *more {
			h.cancelled(cause)
		}
	}
}

func (s *scope) endLocked(cause error) {
	s.cause = cause
	s.ended.Store(true)
}

func (s *scope) cancelled(cause error) { s.cancel(cause) }

// register arranges for h to hear of the scope's end. It returns false
// (and registers nothing) if the scope has already ended.
func (s *scope) register(h canceller) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cause != nil {
		return false
	}
	for i := range s.hooks {
		if s.hooks[i] == nil {
			s.hooks[i] = h
			return true
		}
	}
	if s.more == nil {
		s.more = new([]canceller)
	}
	*s.more = append(*s.more, h)
	return true
}

// unregister takes h back. False means the scope has ended and h has been
// (or is being) told: whatever h guards must be treated as cancelled.
func (s *scope) unregister(h canceller) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cause != nil {
		return false
	}
	for i := range s.hooks {
		if s.hooks[i] == h {
			s.hooks[i] = nil
			return true
		}
	}
	if s.more != nil {
		for i, m := range *s.more {
			if m == h {
				*s.more = append((*s.more)[:i], (*s.more)[i+1:]...)
				return true
			}
		}
	}
	return true
}

// Cause is why the scope ended, nil while it has not.
func (s *scope) Cause() error {
	if !s.ended.Load() {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.cause
}

// The context.Context methods, for the APIs that take one (dialing,
// admission, waits).

func (s *scope) Deadline() (time.Time, bool) { return time.Time{}, false }

func (s *scope) Done() <-chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.done == nil {
		s.done = make(chan struct{})
		if s.cause != nil {
			close(s.done)
		}
	}
	return s.done
}

// Err follows context's rule: DeadlineExceeded for a timeout (the cause
// wraps it), Canceled for any other end.
func (s *scope) Err() error {
	cause := s.Cause()
	switch {
	case cause == nil:
		return nil
	case errors.Is(cause, context.DeadlineExceeded):
		return context.DeadlineExceeded
	}
	return context.Canceled
}

func (s *scope) Value(any) any { return nil }

// AfterFunc is how a context made from the scope (the dialer's deadline)
// hears of its end: through a hook, not a goroutine of the context
// package's waiting on Done, which could run after the request was
// recycled (request.unpin). A context's cancel calls stop before it
// returns; stop waits for an f already started, so nothing touches the
// scope past its derived contexts.
func (s *scope) AfterFunc(f func()) (stop func() bool) {
	h := &afterFunc{f: f}
	if s.register(h) {
		return func() bool { return s.unregister(h) }
	}
	// Ended already: f takes the child's lock, which its caller holds.
	done := make(chan struct{})
	go func() {
		defer close(done)
		f()
	}()
	return func() bool {
		<-done
		return false
	}
}

type afterFunc struct{ f func() }

func (a *afterFunc) cancelled(error) { a.f() }
