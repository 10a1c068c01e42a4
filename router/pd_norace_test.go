//go:build !race

package router

import (
	"testing"
	"time"
)

// A stream's wait for prefill's head allocates nothing (a fresh timer was
// three allocations). Not under -race, whose sync.Pool drops items.
func TestWaitClosedAllocatesNothing(t *testing.T) {
	closed, open := headChannels()
	if n := testing.AllocsPerRun(50, func() {
		waitClosed(closed, time.Hour)
		waitClosed(open, time.Microsecond)
	}); n != 0 {
		t.Fatalf("%v allocations per wait", n)
	}
}
