package router

import (
	"errors"
	"io"
	"net/http"
	"os"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/pdrouter/pdrouter/internal/netutil"
)

// Clients with one worker connection each, the reserve and two workers'
// idle pools fit the fd limit, with half the reserve left for prefill legs.
func TestDescriptorBudgetFitsTheLimit(t *testing.T) {
	for _, limit := range []uint64{256, 1024, 20000, 65536, 1 << 20} {
		clients, idle, reserve := DefaultMaxConnections(limit, UpstreamLegs{HTTP1: 1}), maxIdlePerWorker(limit), fdReserve(limit)
		if used := 2*uint64(clients) + reserve; used > limit {
			t.Errorf("limit %d: %d clients with a worker connection each and a reserve of %d take %d", limit, clients, reserve, used)
		}
		if pools := 2 * uint64(idle); pools > reserve/2 {
			t.Errorf("limit %d: two workers' pools of %d take more than half the reserve %d", limit, idle, reserve)
		}
	}
	// The 9800-stream bench run (hard limit 20,000) fits under the default.
	if n := DefaultMaxConnections(20000, UpstreamLegs{HTTP1: 1}); n < 9800 || n >= 10000 {
		t.Errorf("DefaultMaxConnections(20000) = %d, want 9800..9999", n)
	}
	if maxIdlePerWorker(1<<20) != 500 {
		t.Errorf("a large limit keeps smg's 500 idle connections per worker, got %d", maxIdlePerWorker(1<<20))
	}
}

// emfileDials makes the first n dials of u fail as a process out of
// descriptors does.
func emfileDials(u *upstream, n int32) *atomic.Int32 {
	var dials atomic.Int32
	u.dialer.Control = func(string, string, syscall.RawConn) error {
		if dials.Add(1) <= n {
			return os.NewSyscallError("socket", syscall.EMFILE)
		}
		return nil
	}
	return &dials
}

// A dial out of descriptors frees the pooled idle connections (of any
// worker) and tries again, so the request is served once descriptors are
// back instead of failing.
func TestDialOutOfDescriptorsDropsTheIdlePoolAndWaits(t *testing.T) {
	ok := func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") }
	idleSrv, idleConns := countingServer(t, ok)
	srv, _ := countingServer(t, ok)
	u := newUpstream(time.Minute)
	defer u.close()
	get := func(url string) error {
		resp, err := u.post(&scope{}, url, "/", bodyOf(nil), nil, nil)
		if err != nil {
			return err
		}
		defer resp.Close()
		body, err := io.ReadAll(resp)
		if err == nil && string(body) != "ok" {
			err = errors.New("body " + string(body))
		}
		return err
	}
	if err := get(idleSrv.URL); err != nil {
		t.Fatal(err)
	}
	if idleConns.openCount() != 1 {
		t.Fatalf("%d connections pooled, want 1", idleConns.openCount())
	}
	dials := emfileDials(u, 3)
	start := time.Now()
	if err := get(srv.URL); err != nil {
		t.Fatalf("request after 3 EMFILE dials: %v", err)
	}
	if n := dials.Load(); n != 4 {
		t.Errorf("%d dials, want 3 refused and 1 served", n)
	}
	if d := time.Since(start); d > u.localWait {
		t.Errorf("took %v, more than localWait %v", d, u.localWait)
	}
	waitFor(t, func() bool { return idleConns.openCount() == 0 })
}

// Descriptors that stay out fail the dial once localWait is spent, with
// the error that says so (the worker is not blamed: outOfLocalResources);
// a request ending first ends the wait.
func TestDialOutOfDescriptorsGivesUp(t *testing.T) {
	srv, conns := countingServer(t, func(w http.ResponseWriter, r *http.Request) {})
	u := newUpstream(time.Minute)
	defer u.close()
	u.localWait = 100 * time.Millisecond
	emfileDials(u, 1<<30)
	start := time.Now()
	_, err := u.post(&scope{}, srv.URL, "/", bodyOf(nil), nil, nil)
	if !outOfLocalResources(err) {
		t.Fatalf("error %v, want EMFILE", err)
	}
	if d := time.Since(start); d < u.localWait || d > u.localWait+time.Second {
		t.Errorf("gave up after %v, want about localWait (%v)", d, u.localWait)
	}

	u.localWait = time.Minute
	var sc scope
	time.AfterFunc(50*time.Millisecond, func() { sc.cancel(errClientGone) })
	start = time.Now()
	if _, err = u.post(&sc, srv.URL, "/", bodyOf(nil), nil, nil); err == nil {
		t.Fatal("a request cancelled while its dial waited succeeded")
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("cancelled request took %v", d)
	}
	if !strings.Contains(err.Error(), errClientGone.Error()) {
		t.Errorf("error %v, want the request's cause (%v)", err, errClientGone)
	}
	if conns.acceptedCount() != 0 {
		t.Errorf("%d connections reached the worker", conns.acceptedCount())
	}
}

// Issue 26 item 7: a PD request holds two worker sockets (prefill and
// decode) beside its client's, so the default connection limit of a PD
// router leaves three descriptors per client; at the old default the
// router ran out of descriptors and clients got resets instead of a 503.
func TestDefaultMaxConnectionsCountsBothPDLegs(t *testing.T) {
	soft, _, err := netutil.RaiseFileLimit()
	if err != nil {
		t.Skip("no fd limit here:", err)
	}
	for _, pd := range []bool{false, true} {
		s := &Server{cfg: DefaultConfig()}
		s.cfg.PDDisaggregation = pd
		perClient := map[bool]uint64{false: 2, true: 3}[pd]
		if n := uint64(s.MaxConnections()); perClient*n+fdReserve(soft) > soft {
			t.Errorf("pd %v: %d clients with %d descriptors each and a reserve of %d exceed the limit %d", pd, n, perClient, fdReserve(soft), soft)
		}
	}
}
