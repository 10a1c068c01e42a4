package balancer

import (
	"context"
	"sync/atomic"
	"testing"
	"time"
)

// runNowAndEvery runs fn before the first tick and stops when ctx ends;
// runEvery waits for the first tick.
func TestRunNowAndEvery(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	var now, ticked atomic.Int32
	done := make(chan struct{}, 2)
	go func() { runNowAndEvery(ctx, time.Hour, func() { now.Add(1) }); done <- struct{}{} }()
	go func() { runEvery(ctx, time.Hour, func() { ticked.Add(1) }); done <- struct{}{} }()
	waitFor(t, "the first round", func() bool { return now.Load() == 1 })
	cancel()
	<-done
	<-done
	if now.Load() != 1 || ticked.Load() != 0 {
		t.Fatalf("rounds before an hour's tick: runNowAndEvery %d, runEvery %d; want 1, 0", now.Load(), ticked.Load())
	}
}
