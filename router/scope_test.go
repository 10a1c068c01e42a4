package router

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

type countingHook struct {
	calls atomic.Int32
	cause error
}

func (h *countingHook) cancelled(cause error) { h.cause = cause; h.calls.Add(1) }

func TestScopeCancelReachesHooksAndChildrenOnce(t *testing.T) {
	root, child := &scope{}, &scope{}
	child.inherit(root)
	hooks := make([]*countingHook, 5) // more than the inline slots
	for i := range hooks {
		hooks[i] = &countingHook{}
		if !child.register(hooks[i]) {
			t.Fatal("register on a live scope failed")
		}
	}
	gone := &countingHook{}
	child.register(gone)
	if !child.unregister(gone) {
		t.Fatal("unregister on a live scope reported cancellation")
	}
	done := child.Done()
	cause := errors.New("client left")
	root.cancel(cause)
	root.cancel(errors.New("second cancel is ignored"))
	<-done
	for i, h := range hooks {
		if h.calls.Load() != 1 || h.cause != cause {
			t.Errorf("hook %d: %d calls, cause %v", i, h.calls.Load(), h.cause)
		}
	}
	if gone.calls.Load() != 0 {
		t.Error("an unregistered hook was called")
	}
	if child.Cause() != cause || child.Err() != context.Canceled {
		t.Errorf("child: cause %v, err %v", child.Cause(), child.Err())
	}
	if child.register(&countingHook{}) {
		t.Error("register on an ended scope succeeded")
	}
	if child.unregister(hooks[0]) {
		t.Error("unregister after the end must report cancellation")
	}
}

func TestScopeChildOfEndedParentStartsEnded(t *testing.T) {
	root, child := &scope{}, &scope{}
	root.cancel(errRequestTimeout)
	child.inherit(root)
	if child.Cause() != errRequestTimeout || child.Err() != context.DeadlineExceeded {
		t.Fatalf("cause %v err %v", child.Cause(), child.Err())
	}
	select {
	case <-child.Done():
	default:
		t.Fatal("Done of an ended scope is open")
	}
}

// A scope is a context: what the standard library derives from it ends
// with it.
func TestScopeAsContext(t *testing.T) {
	root := &scope{}
	derived, stop := context.WithCancel(root)
	defer stop()
	if root.Err() != nil || derived.Err() != nil {
		t.Fatal("ended before cancel")
	}
	root.cancel(errClientGone)
	<-derived.Done()
	if context.Cause(derived) != context.Canceled {
		t.Fatalf("derived cause %v", context.Cause(derived))
	}
}

// Cause reads a live scope's without its lock (about eight calls per
// request, each a lock and unlock before), and an ended one's whole: a
// Cause racing the cancel sees nil or the cause, never a torn value.
func TestScopeCauseOfALiveScopeTakesNoLock(t *testing.T) {
	s := &scope{}
	s.mu.Lock()
	got := make(chan error, 1)
	go func() { got <- s.Cause() }()
	select {
	case err := <-got:
		if err != nil {
			t.Fatalf("live scope's cause %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Cause waited for the scope's lock")
	}
	s.mu.Unlock()

	for range 100 {
		s := &scope{}
		var wg sync.WaitGroup
		wg.Go(func() { s.cancel(errClientGone) })
		for range 2 {
			wg.Go(func() {
				for s.Cause() == nil {
				}
				if s.Cause() != errClientGone || s.Err() != context.Canceled {
					t.Errorf("cause %v err %v after the cancel", s.Cause(), s.Err())
				}
			})
		}
		wg.Wait()
	}
}
