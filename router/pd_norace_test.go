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

// A non-streamed PD request allocates the request and its attempt, and
// little else, client and canned engines included (before: 7, with the
// prefill goroutine's done channel and a struct per reply head). Not under
// -race, whose sync.Pool drops items.
func TestPDRequestAllocations(t *testing.T) {
	post := pdPoster(t)
	for range 20 {
		post()
	}
	if n := testing.AllocsPerRun(300, post); n > 3 {
		t.Fatalf("%v allocations per PD request, want at most 3", n)
	}
}
