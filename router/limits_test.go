package router

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/pdrouter/pdrouter/balancer"
	"github.com/pdrouter/pdrouter/internal/netutil"
	"github.com/pdrouter/pdrouter/mock/mockworker"
)

// side is the workers of one type in a table case: how many serve h2c and
// how many HTTP/1.1.
type side struct{ h2c, http1 int }

// snapshotOf registers workers of each side's type and returns the snapshot.
func snapshotOf(sides map[balancer.WorkerType]side) *balancer.Snapshot {
	reg := balancer.NewRegistry()
	for t, s := range sides {
		for i := range s.h2c + s.http1 {
			w := balancer.NewWorker(fmt.Sprintf("http://%s-%d:8000", t, i), t, balancer.NoBootstrapPort)
			w.HTTP2 = i < s.h2c
			reg.Add(w)
		}
	}
	return reg.Snapshot()
}

// Issue 24: a leg to workers that all serve h2c costs a client no socket
// of its own, so the default limit grows to what the descriptors hold.
func TestDefaultMaxConnectionsFollowsLegs(t *testing.T) {
	pdSides := []balancer.WorkerType{balancer.Prefill, balancer.Decode}
	regular := []balancer.WorkerType{balancer.Regular}
	for _, c := range []struct {
		name    string
		fdLimit uint64
		sides   []balancer.WorkerType
		workers map[balancer.WorkerType]side
		want    int
	}{
		{"regular, none registered", 20000, regular, nil, 9844},
		{"regular http1", 20000, regular, map[balancer.WorkerType]side{balancer.Regular: {http1: 1}}, 9844},
		{"regular h2c", 20000, regular, map[balancer.WorkerType]side{balancer.Regular: {h2c: 1}}, 19489},
		{"pd, none registered", 20000, pdSides, nil, 6562},
		{"pd http1", 20000, pdSides, map[balancer.WorkerType]side{balancer.Prefill: {http1: 1}, balancer.Decode: {http1: 1}}, 6562},
		{"pd h2c", 20000, pdSides, map[balancer.WorkerType]side{balancer.Prefill: {h2c: 1}, balancer.Decode: {h2c: 1}}, 19294},
		{"pd prefill h2c, decode http1", 20000, pdSides, map[balancer.WorkerType]side{balancer.Prefill: {h2c: 1}, balancer.Decode: {http1: 1}}, 9793},
		{"pd decode h2c, prefill not yet registered", 20000, pdSides, map[balancer.WorkerType]side{balancer.Decode: {h2c: 1}}, 9793},
		{"pd decode mixed", 20000, pdSides, map[balancer.WorkerType]side{balancer.Prefill: {h2c: 2}, balancer.Decode: {h2c: 1, http1: 1}}, 9791},
		{"pd h2c, small limit", 1024, pdSides, map[balancer.WorkerType]side{balancer.Prefill: {h2c: 1}, balancer.Decode: {h2c: 1}}, 933},
		{"pd http1, small limit", 1024, pdSides, nil, 320},
		{"pd, tiny limit", 100, pdSides, nil, 16},
		{"pd http1, huge limit capped", 1 << 22, pdSides, nil, 697685},
		{"pd h2c, huge limit capped", 1 << 22, pdSides, map[balancer.WorkerType]side{balancer.Prefill: {h2c: 1}, balancer.Decode: {h2c: 1}}, 2052007},
	} {
		t.Run(c.name, func(t *testing.T) {
			legs := upstreamLegs(c.sides, snapshotOf(c.workers))
			got := DefaultMaxConnections(c.fdLimit, legs)
			if got != c.want {
				t.Fatalf("DefaultMaxConnections(%d, %+v) = %d, want %d", c.fdLimit, legs, got, c.want)
			}
			// What the clients admitted hold fits beside the reserve:
			// their sockets, one per HTTP/1.1 leg, and the h2c
			// connections their streams fill.
			limit := min(c.fdLimit, 1<<21)
			n := uint64(got)
			h2cConns := (n*uint64(legs.H2C) + h2cDefaultStreams - 1) / h2cDefaultStreams
			if used := n*(1+uint64(legs.HTTP1)) + h2cConns + fdReserve(limit); got > 16 && used > limit {
				t.Errorf("%d clients take %d descriptors, over the limit %d", got, used, limit)
			}
		})
	}
}

// frontMax is the limit the router's front listeners hold now.
func frontMax(t *testing.T, s *Server) int {
	t.Helper()
	s.front.mu.Lock()
	defer s.front.mu.Unlock()
	if len(s.front.listeners) != 1 {
		t.Fatalf("%d front listeners, want 1", len(s.front.listeners))
	}
	return s.front.listeners[0].MaxConns()
}

// fdLimitHere is this process's open-file limit as the router reads it.
func fdLimitHere(t *testing.T) uint64 {
	t.Helper()
	soft, _, err := netutil.RaiseFileLimit()
	if err != nil {
		t.Skip("no fd limit here:", err)
	}
	return min(soft, 1<<21)
}

// awaitFrontMax waits until the front listener's limit is want.
func awaitFrontMax(t *testing.T, s *Server, want int, why string) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); frontMax(t, s) != want; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%s: front limit %d, want %d", why, frontMax(t, s), want)
		}
	}
}

func TestClientLimitFollowsH2CWorkers(t *testing.T) {
	fd := fdLimitHere(t)
	reserve := fdReserve(fd)
	_, srv, _, _ := h2cPD(t, mockworker.Config{}, mockworker.Config{})
	// Both legs h2c: a client costs its own socket and 1/100 of an h2c
	// connection per leg, where HTTP/1.1 legs cost it three sockets.
	bothH2C := int((fd - reserve - 2*h2cWorkerAllowance) * 100 / 102)
	awaitFrontMax(t, srv, bothH2C, "prefill and decode serve h2c")
	if http1 := int((fd - reserve) / 3); bothH2C <= 2*http1 {
		t.Fatalf("h2c limit %d, not above twice the HTTP/1.1 one %d", bothH2C, http1)
	}

	// A decode worker that speaks HTTP/1.1 only: decode legs may need a
	// socket each again.
	h1, err := mockworker.Start(mockworker.Config{Role: mockworker.RoleDecode})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h1.Close() })
	id, err := srv.manager.Add(balancer.WorkerSpec{URL: h1.URL(), WorkerType: balancer.Decode.String()})
	if err != nil {
		t.Fatal(err)
	}
	if err := srv.manager.Await(context.Background(), id); err != nil {
		t.Fatal(err)
	}
	awaitFrontMax(t, srv, int((fd-reserve-h2cWorkerAllowance)*100/201), "an HTTP/1.1 decode worker joined")

	if _, ok := srv.manager.Remove(h1.URL()); !ok {
		t.Fatal("HTTP/1.1 decode worker not removed")
	}
	awaitFrontMax(t, srv, bothH2C, "the HTTP/1.1 decode worker left")
}

func TestClientLimitStaysForHTTP1Workers(t *testing.T) {
	fd := fdLimitHere(t)
	cfg := DefaultConfig()
	cfg.PDDisaggregation = true
	cfg.Manager.UpstreamHTTP2 = true // asked for, but the workers do not serve h2c
	for _, role := range []mockworker.Role{mockworker.RolePrefill, mockworker.RoleDecode} {
		w, err := mockworker.Start(mockworker.Config{Role: role})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { w.Close() })
		if role == mockworker.RolePrefill {
			cfg.Prefill = []PrefillSpec{{URL: w.URL(), BootstrapPort: 8998}}
		} else {
			cfg.Decode = []string{w.URL()}
		}
	}
	_, srv := serveInProcess(t, cfg)
	t.Cleanup(func() { srv.Shutdown(context.Background()) })
	waitFor(t, func() bool { return len(srv.reg.Snapshot().All) == 2 })
	if got, want := frontMax(t, srv), int((fd-fdReserve(fd))/3); got != want {
		t.Fatalf("front limit %d with HTTP/1.1 workers, want %d", got, want)
	}
}

// An explicit --max-connections is never recomputed.
func TestExplicitMaxConnectionsStays(t *testing.T) {
	_, srv, _, _ := h2cPDWith(t, mockworker.Config{}, mockworker.Config{}, func(c *Config) { c.MaxConnections = 50 })
	waitFor(t, func() bool { return len(srv.reg.Snapshot().All) == 2 })
	if got := frontMax(t, srv); got != 50 {
		t.Fatalf("front limit %d, want --max-connections 50", got)
	}
}
