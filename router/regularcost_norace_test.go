//go:build !race

package router

import "testing"

// A non-streamed regular request allocates its request and nothing else,
// client and canned engine included (before: also fasthttp's LimitReader
// of a streamed body, with the stream's set-up, copy and discard). Not
// under -race, whose sync.Pool drops items.
func TestRegularRequestAllocations(t *testing.T) {
	post := regularPoster(t)
	for range 20 {
		post()
	}
	if n := testing.AllocsPerRun(300, post); n > 1 {
		t.Fatalf("%v allocations per regular request, want at most 1", n)
	}
}
