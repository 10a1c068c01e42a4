//go:build !race

package router

import "testing"

// A non-streamed regular request allocates nothing, client and canned
// engine included: its request comes from a pool (before: the request, and
// before that also fasthttp's LimitReader of a streamed body). Not under
// -race, whose sync.Pool drops items.
func TestRegularRequestAllocations(t *testing.T) {
	post := regularPoster(t)
	for range 20 {
		post()
	}
	if n := testing.AllocsPerRun(300, post); n > 0 {
		t.Fatalf("%v allocations per regular request, want none", n)
	}
}
