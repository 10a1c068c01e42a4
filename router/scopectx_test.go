package router

import (
	"context"
	"errors"
	"testing"
	"time"

	"go.uber.org/goleak"
)

// A context made from a scope (the dialer's deadline) is told of the
// scope's end through a hook, with no goroutine of the context package's
// waiting on the scope: one could run after the request was recycled.
func TestScopeDerivedContextHoldsNoGoroutine(t *testing.T) {
	var sc scope
	before := goleak.IgnoreCurrent()
	ctx, cancel := context.WithDeadline(&sc, time.Now().Add(time.Hour))
	if err := goleak.Find(before); err != nil {
		t.Fatalf("a goroutine waits on the scope for its derived context: %v", err)
	}
	cause := errors.New("client gone")
	sc.cancel(cause)
	select {
	case <-ctx.Done():
	default:
		t.Fatal("the derived context outlived its scope")
	}
	if ctx.Err() != context.Canceled {
		t.Fatalf("derived context's error %v, want Canceled", ctx.Err())
	}
	cancel()

	// Cancelled first, it leaves no hook behind.
	var live scope
	_, cancel = context.WithTimeout(&live, time.Hour)
	cancel()
	if live.hooks != [3]canceller{} || live.more != nil {
		t.Fatalf("a cancelled derived context is still registered: %v", live.hooks)
	}
}

// On a scope already ended, AfterFunc runs f on a goroutine of its own (its
// caller may hold the lock f takes) and stop returns once f has.
func TestScopeAfterFuncOnAnEndedScope(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	var sc scope
	sc.cancel(context.Canceled)
	ran := false
	stop := sc.AfterFunc(func() {
		time.Sleep(10 * time.Millisecond)
		ran = true
	})
	if stop() {
		t.Fatal("stop reported that it stopped f on an ended scope")
	}
	if !ran { // under -race, also a race if stop did not wait
		t.Fatal("stop returned before f did")
	}
}
