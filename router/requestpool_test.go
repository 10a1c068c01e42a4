package router

import (
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/valyala/fasthttp"
	"go.uber.org/goleak"
	"go.uber.org/zap"

	"github.com/pdrouter/pdrouter/balancer"
)

// Regular requests are pooled (request.unpin): these tests pin down that a
// request goes back to the pool only once nothing can touch it, and comes
// back with nothing of its previous use.

// verifyNoLeaksAtCleanup checks for goroutines left once the test and its
// other cleanups (the server's shutdown) are done.
func verifyNoLeaksAtCleanup(t *testing.T) {
	ignore := goleak.IgnoreCurrent()
	t.Cleanup(func() {
		goleak.VerifyNone(t, ignore,
			goleak.IgnoreAnyFunction("github.com/valyala/fasthttp.updateServerDate.func1"),
			goleak.IgnoreAnyFunction("github.com/valyala/fasthttp.(*workerPool).Start.func2"))
	})
}

// pooledServer is a regular-mode router in process with one canned worker.
func pooledServer(t *testing.T) *Server {
	t.Helper()
	cfg := DefaultConfig()
	cfg.WorkerURLs = []string{cannedBackend(t, false)}
	_, srv := serveInProcess(t, cfg)
	t.Cleanup(func() { shutdown(t, srv) })
	return srv
}

// handlerCtx is what fasthttp hands a handler for a small POST.
func handlerCtx(id string) *fasthttp.RequestCtx {
	var req fasthttp.Request
	req.Header.SetMethod("POST")
	req.SetRequestURI("/generate")
	req.Header.Set("X-Request-Id", id)
	req.SetBodyString(`{"text":"` + id + `"}`)
	ctx := new(fasthttp.RequestCtx)
	ctx.Init(&req, &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 1}, nil)
	return ctx
}

func (s *Server) testRequest(id string) *request {
	return s.newRequest(handlerCtx(id), "/generate", routeGenerate, []byte(id))
}

// blockingHook holds the goroutine cancelling its scope until released.
type blockingHook struct{ entered, release chan struct{} }

func (h *blockingHook) cancelled(error) {
	close(h.entered)
	<-h.release
}

// The sweeper cancels expired requests outside its lock. A request whose
// handler finishes meanwhile must not be reused before the sweeper is done
// with it: the next request would be cancelled in its name (or, without
// the sweeper's pin, its zeroing races the cancel).
func TestSweeperHoldsAnExpiredRequestUntilItsCancelIsDone(t *testing.T) {
	verifyNoLeaksAtCleanup(t)
	s := pooledServer(t)
	for i := range 20 {
		first, second := s.testRequest("first"), s.testRequest("second")
		hook := &blockingHook{entered: make(chan struct{}), release: make(chan struct{})}
		first.scope.register(hook)
		swept := make(chan struct{})
		go func() {
			defer close(swept)
			s.inflight.sweep(time.Now().Add(time.Hour + s.cfg.RequestTimeout)) // both expired
		}()
		<-hook.entered // the sweeper holds both, and is cancelling first
		second.finish()
		next := s.testRequest("next")
		reused := next == second
		close(hook.release)
		<-swept
		nextCause, firstCause := next.scope.Cause(), first.scope.Cause()
		first.finish()
		next.finish()
		if reused {
			t.Fatalf("round %d: a request the sweeper still held was reused", i)
		}
		if nextCause != nil {
			t.Fatalf("round %d: the next request was cancelled (%v) by the sweeper's cancel of another", i, nextCause)
		}
		if firstCause != errRequestTimeout {
			t.Fatalf("round %d: the expired request's cause is %v", i, firstCause)
		}
	}
	waitFor(t, func() bool { return s.live.Load() == 0 })
}

// Hard shutdown cancels every request outside the tracker's lock too.
func TestShutdownHoldsTheRequestsItCancels(t *testing.T) {
	verifyNoLeaksAtCleanup(t)
	s := pooledServer(t)
	first, second := s.testRequest("first"), s.testRequest("second")
	hook := &blockingHook{entered: make(chan struct{}), release: make(chan struct{})}
	first.scope.register(hook)
	closed := make(chan struct{})
	go func() {
		defer close(closed)
		s.inflight.close()
	}()
	<-hook.entered // close holds both, and is cancelling first
	second.finish()
	next := s.testRequest("next") // begins cancelled: the tracker is closed
	reused := next == second
	close(hook.release)
	<-closed
	first.finish()
	next.finish()
	if reused {
		t.Fatal("a request the shutdown still held was reused")
	}
}

// Many requests that time out as their handlers finish, and the next
// requests reusing theirs: no request may be cancelled before its own
// timeout. Meant for -race -count=20.
func TestSweeperCancelsWhileHandlersFinishAndReuse(t *testing.T) {
	verifyNoLeaksAtCleanup(t)
	s := pooledServer(t)
	const timeout = watchDelay + 10*time.Millisecond // the sweeper only times out requests past watchDelay
	s.inflight.mu.Lock()
	s.inflight.timeout = timeout
	s.inflight.mu.Unlock()
	var wg sync.WaitGroup
	errs := make(chan string, 64)
	end := time.Now().Add(400 * time.Millisecond)
	for g := range 16 {
		wg.Go(func() {
			for i := 0; time.Now().Before(end); i++ {
				r := s.testRequest("r")
				if cause := r.scope.Cause(); cause != nil {
					errs <- "a new request began cancelled: " + cause.Error()
					r.finish()
					return
				}
				// Half finish as the sweeper times them out, half as soon as
				// the sweeper's cancel wakes them.
				wait := time.Until(r.start.Add(timeout))
				if (g+i)%2 == 0 {
					wait += time.Hour
				}
				timer := time.NewTimer(wait)
				select {
				case <-timer.C:
				case <-r.scope.Done():
					if age := time.Since(r.start); age < timeout {
						select {
						case errs <- "cancelled (" + r.scope.Cause().Error() + ") at " + age.String() + ", before its timeout":
						default:
						}
					}
				}
				timer.Stop()
				r.finish()
			}
		})
	}
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Error(e)
	}
	waitFor(t, func() bool { return s.live.Load() == 0 })
}

// An engine abort's goroutine ends with Done on its request's WaitGroup,
// maybe after the request has ended: until then the request is not reused.
func TestEngineAbortHoldsItsRequest(t *testing.T) {
	verifyNoLeaksAtCleanup(t)
	arrived, answer := make(chan struct{}, 1), make(chan struct{})
	engine := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		if req.URL.Path == "/abort_request" {
			arrived <- struct{}{}
			<-answer
		}
	}))
	defer engine.Close()
	s := pooledServer(t)
	w := balancer.NewWorker(engine.URL, balancer.Regular, 0)

	r := s.testRequest("aborted")
	s.abortEngine(w, engineRID{val: []byte(`"aborted"`), batch: 1}, r)
	<-arrived
	r.finish()
	next := s.testRequest("next")
	if next == r {
		t.Fatal("a request whose engine abort is under way was reused")
	}
	close(answer) // without the pin: Done on next's WaitGroup, a negative count
	waitFor(t, func() bool { return s.aborts.inFlight.Load() == 0 })
	next.finish()
	waitFor(t, func() bool { return s.live.Load() == 0 })
}

// spyPolicy picks the first worker it is offered, as a test wants, and
// notes what each request brought it.
type spyPolicy struct {
	balancer.Policy
	prefer string
	mu     sync.Mutex
	seen   []spySelection
}

type spySelection struct {
	pr    *balancer.Request // the request's own (request.policy): the same pointer means the same request
	id    string
	avail []string
}

func (p *spyPolicy) Select(workers []*balancer.Worker, pr *balancer.Request) (*balancer.Worker, error) {
	sel := spySelection{pr: pr, id: pr.Header.Get("X-Request-Id")}
	pick := workers[0]
	for _, w := range workers {
		sel.avail = append(sel.avail, w.URL)
		if w.URL == p.prefer {
			pick = w
		}
	}
	p.mu.Lock()
	p.seen = append(p.seen, sel)
	p.mu.Unlock()
	return pick, nil
}

// A reused request carries nothing from its previous use: a streamed
// request that failed on one worker, was retried on another and had its
// own request id is followed, in the same memory, by a plain one that must
// see every worker, send its own id, get a whole reply and count once in
// the metrics.
func TestPooledRequestCarriesNothingOver(t *testing.T) {
	verifyNoLeaksAtCleanup(t)
	sawID := make(chan string, 1024)
	engine := func(failFirst bool) *httptest.Server {
		return httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
			if req.URL.Path != "/generate" {
				return // the router's discovery calls
			}
			body, _ := io.ReadAll(req.Body)
			id := req.Header.Get("X-Request-Id")
			sawID <- id
			switch {
			case failFirst && strings.HasPrefix(id, "dirty"):
				http.Error(w, `{"error":"busy"}`, 500)
			case strings.Contains(string(body), `"stream":true`):
				w.Header().Set("Content-Type", "text/event-stream")
				io.WriteString(w, "data: {\"text\":\"a\"}\n\ndata: [DONE]\n\n")
			default:
				w.Header().Set("Content-Type", "application/json")
				io.WriteString(w, `{"text":"ok"}`)
			}
		}))
	}
	failing, good := engine(true), engine(false)
	defer failing.Close()
	defer good.Close()

	cfg := DefaultConfig()
	cfg.WorkerURLs = []string{failing.URL, good.URL}
	cfg.Retry.MaxRetries = 2 // attempts
	cfg.Retry.InitialBackoff = time.Millisecond
	cfg.Policy = "round_robin"
	cfg.Manager.Health.Disabled = true
	prom := prometheus.NewRegistry()
	srv, err := New(cfg, zap.NewNop(), prom)
	if err != nil {
		t.Fatal(err)
	}
	spy := &spyPolicy{Policy: srv.policies[balancer.Regular], prefer: failing.URL}
	srv.policies[balancer.Regular] = spy
	base := serveOnLoopback(t, srv)
	defer shutdown(t, srv)
	waitFor(t, srv.manager.Ready)

	c := &http.Client{Transport: &http.Transport{}}
	defer c.CloseIdleConnections()
	do := func(id, stream string) *http.Response {
		req, _ := http.NewRequest("POST", base+"/generate", strings.NewReader(`{"text":"x","stream":`+stream+`}`))
		req.Header.Set("X-Request-Id", id)
		resp, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp
	}
	reused, pairs := 0, 0
	for ; pairs < 200 && reused < 5; pairs++ {
		if resp := do("dirty", "true"); resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "text/event-stream" {
			t.Fatalf("dirty request: %d %s", resp.StatusCode, resp.Header.Get("Content-Type"))
		}
		resp := do("clean", "false")
		if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "application/json" || resp.Header.Get("X-Request-Id") != "clean" {
			t.Fatalf("clean request after a dirty one: %d %q, id %q", resp.StatusCode, resp.Header.Get("Content-Type"), resp.Header.Get("X-Request-Id"))
		}
		for _, want := range []string{"dirty", "dirty", "clean"} { // dirty on both workers, then clean
			if id := <-sawID; id != want {
				t.Fatalf("a worker was sent request id %q, want %q", id, want)
			}
		}
		spy.mu.Lock()
		dirty, clean := spy.seen[len(spy.seen)-3], spy.seen[len(spy.seen)-1]
		spy.mu.Unlock()
		if clean.id != "clean" || len(clean.avail) != 2 {
			t.Fatalf("clean request's selection: id %q, offered %v (a worker the dirty one failed on left out?)", clean.id, clean.avail)
		}
		if clean.pr == dirty.pr {
			reused++
		}
	}
	if reused == 0 {
		t.Fatalf("no request was reused in %d pairs", pairs)
	}
	select {
	case id := <-sawID:
		t.Fatalf("an extra request reached a worker, id %q", id)
	default:
	}
	waitFor(t, func() bool { return srv.live.Load() == 0 }) // every record emitted
	if n := gathered(t, prom, "smg_worker_errors_total"); n != float64(pairs) {
		t.Errorf("worker errors %v, want one per dirty request (%d)", n, pairs)
	}
	if n := gathered(t, prom, "smg_worker_retries_total"); n != float64(pairs) {
		t.Errorf("retries %v, want one per dirty request (%d)", n, pairs)
	}
	if n := gathered(t, prom, "smg_worker_selection_total"); n != float64(3*pairs) {
		t.Errorf("selections %v, want three per pair (%d)", n, 3*pairs)
	}
}
