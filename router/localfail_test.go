package router

import (
	"net/http"
	"os"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/pdrouter/pdrouter/mock/mockworker"
)

// A router out of descriptors (dials fail with EMFILE) answers those
// requests with an error, but does not blame the worker: its breaker stays
// closed, and the next request once descriptors are back is served. (It
// used to open the breaker, and a burst of streams that ran the router out
// of descriptors then refused everything with 503 until it closed.)
func TestOutOfDescriptorsDoesNotOpenTheWorkersBreaker(t *testing.T) {
	w, err := mockworker.Start(mockworker.Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	cfg := DefaultConfig()
	cfg.WorkerURLs = []string{w.URL()}
	cfg.Policy = "round_robin"
	cfg.Manager.Health.Disabled = true
	cfg.Manager.Breaker.FailureThreshold = 2
	cfg.EventLoops = 0 // the failures come from the fasthttp path's dialer
	srv, err := New(cfg, zap.NewNop(), prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	srv.upstream.localWait = 20 * time.Millisecond // each dial waits that long for descriptors before failing
	var exhausted atomic.Bool
	exhausted.Store(true)
	srv.upstream.dialer.Control = func(string, string, syscall.RawConn) error {
		if exhausted.Load() {
			return os.NewSyscallError("socket", syscall.EMFILE)
		}
		return nil
	}
	base := serveOnLoopback(t, srv)
	defer shutdown(t, srv)
	waitFor(t, srv.manager.Ready)
	post := func() int {
		resp, err := http.Post(base+"/generate", "application/json", strings.NewReader(`{"text":"x"}`))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	for range 5 {
		if status := post(); status/100 != 5 || status == 503 {
			t.Fatalf("status %d while out of descriptors, want a 5xx other than 503", status)
		}
	}
	exhausted.Store(false)
	if status := post(); status != 200 {
		t.Fatalf("status %d once descriptors are back, want 200 (the worker's breaker opened)", status)
	}
}

func TestOutOfLocalResources(t *testing.T) {
	for _, c := range []struct {
		err  error
		want bool
	}{
		{os.NewSyscallError("socket", syscall.EMFILE), true},
		{os.NewSyscallError("socket", syscall.ENFILE), true},
		{os.NewSyscallError("connect", syscall.EADDRNOTAVAIL), true},
		{os.NewSyscallError("connect", syscall.ECONNREFUSED), false},
		{os.NewSyscallError("read", syscall.ECONNRESET), false},
	} {
		if got := outOfLocalResources(c.err); got != c.want {
			t.Errorf("%v: %v, want %v", c.err, got, c.want)
		}
	}
}
