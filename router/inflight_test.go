package router

import (
	"net"
	"testing"
	"testing/synctest"
	"time"
)

func trackedRequest(f *inflight, start time.Time, conn net.Conn) *request {
	r := &request{start: start, conn: conn}
	f.add(r)
	return r
}

// newTestInflight is a tracker whose sweeps the test drives itself.
func newTestInflight(t *testing.T, timeout time.Duration) *inflight {
	f := &inflight{timeout: timeout, kick: make(chan struct{}, 1), stop: make(chan struct{}), done: make(chan struct{})}
	close(f.done)
	t.Cleanup(func() { close(f.stop); f.watcher.close() })
	return f
}

func TestInflightTimesOutOldestFirstAndOnlyLiveRequests(t *testing.T) {
	f := newTestInflight(t, time.Second)
	t0 := time.Now()
	old := trackedRequest(f, t0, nil)
	ended := trackedRequest(f, t0.Add(time.Millisecond), nil)
	young := trackedRequest(f, t0.Add(500*time.Millisecond), nil)
	f.finished(ended)
	f.remove(ended)

	f.sweep(t0.Add(watchDelay + time.Millisecond)) // old and ended are past watchDelay
	if old.scope.Err() != nil || young.scope.Err() != nil {
		t.Fatal("cancelled before the timeout")
	}
	if f.long.Len() != 1 || f.long.Front().Value != old {
		t.Fatalf("long list should hold only the old live request")
	}
	f.sweep(t0.Add(time.Second))
	if old.scope.Cause() != errRequestTimeout {
		t.Fatalf("old request: cause %v, want the request timeout", old.scope.Cause())
	}
	if ended.scope.Cause() != nil {
		t.Fatal("a released request was cancelled")
	}
	if young.scope.Err() != nil {
		t.Fatal("young request timed out early")
	}
	f.sweep(t0.Add(1500 * time.Millisecond))
	if young.scope.Cause() != errRequestTimeout {
		t.Fatalf("young request: cause %v", young.scope.Cause())
	}
	if !f.emptyLocked() {
		t.Fatal("tracker not empty after every request ended")
	}
}

// A request answered before watchDelay never gets a watch; one still
// waiting does, and the watch reports the client leaving.
func TestInflightWatchesOnlyLongRequests(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	client, server := tcpPair(t, ln)
	defer server.Close()

	f := newTestInflight(t, time.Hour)
	t0 := time.Now()
	quick := trackedRequest(f, t0, server)
	if f.finished(quick) {
		t.Fatal("watch started before watchDelay")
	}
	f.sweep(t0.Add(watchDelay))
	if quick.track.watching {
		t.Fatal("a request answered in time got a watch")
	}
	f.remove(quick)

	slow := trackedRequest(f, t0, server)
	f.sweep(t0.Add(watchDelay))
	if !slow.track.watching {
		t.Fatal("no watch on a request older than watchDelay")
	}
	client.Close()
	select {
	case <-slow.scope.Done():
		if slow.scope.Cause() != errClientGone {
			t.Fatalf("cause %v, want errClientGone", slow.scope.Cause())
		}
	case <-time.After(5 * time.Second):
		t.Fatal("client disconnect not seen")
	}
	if !f.finished(slow) {
		t.Fatal("the watch was not stopped")
	}
	f.remove(slow)
}

// Under steady traffic the young queue never drains; it must not grow.
func TestInflightQueueStaysBoundedUnderSteadyTraffic(t *testing.T) {
	f := newTestInflight(t, time.Hour)
	t0 := time.Now()
	var live []*request
	const gap = 10 * time.Microsecond // 100k req/s
	perDelay := int(watchDelay / gap) // arrivals while a request is young
	for i := range 50 * perDelay {
		now := t0.Add(time.Duration(i) * gap)
		r := trackedRequest(f, now, nil)
		live = append(live, r)
		if len(live) > 20 { // 20 in flight, answered in 200 µs
			f.finished(live[0])
			f.remove(live[0])
			live = live[1:]
		}
		if i%100 == 0 {
			f.sweep(now)
		}
	}
	// watchDelay of arrivals, twice that after compaction, and append's slack.
	if cap(f.young) > 4*perDelay {
		t.Fatalf("young queue grew to %d", cap(f.young))
	}
}

func TestInflightCloseCancelsEverythingAndLaterRequests(t *testing.T) {
	f := newInflight(time.Hour)
	t0 := time.Now()
	a := trackedRequest(f, t0.Add(-time.Second), nil) // promoted by the first sweep
	b := trackedRequest(f, t0, nil)
	time.Sleep(5 * sweepTick)
	f.close()
	for _, r := range []*request{a, b} {
		if r.scope.Err() == nil {
			t.Fatal("request still live after close")
		}
	}
	late := trackedRequest(f, time.Now(), nil)
	if late.scope.Err() == nil {
		t.Fatal("request added after close is live")
	}
}

// The sweeper sleeps once nothing is in flight, and wakes for new work.
func TestInflightSweeperSleepsWhenIdle(t *testing.T) {
	f := newInflight(time.Hour)
	defer f.close()
	r := trackedRequest(f, time.Now(), nil)
	f.finished(r)
	f.remove(r)
	waitFor(t, func() bool { f.mu.Lock(); defer f.mu.Unlock(); return f.idle })
	r = trackedRequest(f, time.Now().Add(-time.Hour), nil) // already past the timeout
	waitFor(t, func() bool { return r.scope.Err() != nil })
	if r.scope.Cause() != errRequestTimeout {
		t.Fatalf("cause %v", r.scope.Cause())
	}
}

// Under steady short requests the sweeper wakes about once per
// watchDelay, and with nothing in flight not at all (before: every
// sweepTick while anything was in flight, a wakeup per 30 requests at
// 30,000 req/s). A request still in flight is promoted at watchDelay and
// times out at --request-timeout-secs, each within a sweepTick.
func TestInflightSweeperWakesOnlyWhenDue(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const timeout = time.Second
		f := newInflight(timeout)
		defer f.close()
		sweeps := func() int { f.mu.Lock(); defer f.mu.Unlock(); return f.sweeps }
		const traffic = 500 * time.Millisecond
		var live []*request
		for range traffic / (100 * time.Microsecond) { // one request every 100 µs, each answered 200 µs later
			live = append(live, trackedRequest(f, time.Now(), nil))
			if len(live) > 2 {
				f.finished(live[0])
				f.remove(live[0])
				live = live[1:]
			}
			time.Sleep(100 * time.Microsecond)
		}
		if n := sweeps(); n > int(traffic/(watchDelay-sweepTick))+2 {
			t.Fatalf("%d sweeps in %v of requests answered in 200 µs, want about one per %v", n, traffic, watchDelay)
		}
		f.mu.Lock()
		held := 0
		for _, r := range f.young[f.youngHead:] {
			if r != nil {
				held++
			}
		}
		f.mu.Unlock()
		if held != len(live) { // a released request is garbage at once
			t.Fatalf("the young queue holds %d requests, %d of them in flight", held, len(live))
		}
		for _, r := range live {
			f.finished(r)
			f.remove(r)
		}
		time.Sleep(watchDelay + sweepTick)
		quiet := sweeps()
		time.Sleep(time.Minute)
		if n := sweeps(); n != quiet {
			t.Fatalf("%d sweeps in a minute with nothing in flight", n-quiet)
		}

		start := time.Now()
		r := trackedRequest(f, start, nil)
		time.Sleep(watchDelay + sweepTick)
		synctest.Wait()
		f.mu.Lock()
		promoted := r.track.long != nil
		f.mu.Unlock()
		if !promoted {
			t.Fatalf("a request in flight for %v is not in the long list", time.Since(start))
		}
		time.Sleep(start.Add(timeout - sweepTick).Sub(time.Now()))
		synctest.Wait()
		if r.scope.Err() != nil {
			t.Fatalf("timed out after %v, before %v", time.Since(start), timeout)
		}
		time.Sleep(2 * sweepTick)
		synctest.Wait()
		if r.scope.Cause() != errRequestTimeout {
			t.Fatalf("cause %v %v after the request started, want the request timeout", r.scope.Cause(), time.Since(start))
		}
		f.remove(r)
	})
}

// A request that starts while the sweeper sleeps until an older one's
// timeout still gets its watch at watchDelay.
func TestInflightWatchesANewRequestWhileAnOldOneAwaitsItsTimeout(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newInflight(time.Hour)
		defer f.close()
		promoted := func(r *request) bool { f.mu.Lock(); defer f.mu.Unlock(); return r.track.long != nil }
		old := trackedRequest(f, time.Now(), nil)
		time.Sleep(watchDelay + sweepTick)
		synctest.Wait()
		if !promoted(old) {
			t.Fatal("the first request is not in the long list after watchDelay")
		}
		start := time.Now()
		young := trackedRequest(f, start, nil)
		time.Sleep(watchDelay + sweepTick)
		synctest.Wait()
		if !promoted(young) {
			t.Fatalf("a request in flight for %v is not in the long list", time.Since(start))
		}
		f.remove(old)
		f.remove(young)
	})
}

// BenchmarkInflight is what the tracker costs a request that ends before its
// watch starts (most requests of a zero-delay benchmark). The request itself
// is allocated per iteration, as on the server.
func BenchmarkInflight(b *testing.B) {
	f := newInflight(time.Hour)
	defer f.close()
	b.ReportAllocs()
	for b.Loop() {
		r := &request{start: time.Now()}
		f.add(r)
		f.finished(r)
		f.remove(r)
	}
}
