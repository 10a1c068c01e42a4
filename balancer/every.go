package balancer

import (
	"context"
	"time"
)

// runEvery calls fn every period until ctx ends: the background work of
// policies that implement Runner.
func runEvery(ctx context.Context, period time.Duration, fn func()) {
	t := time.NewTicker(period)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			fn()
		}
	}
}

// runNowAndEvery calls fn at once, then every period until ctx ends: health
// checks and load polls want their first round before the first tick.
func runNowAndEvery(ctx context.Context, period time.Duration, fn func()) {
	fn()
	runEvery(ctx, period, fn)
}
