package loadgen

import (
	"context"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// fakeEngine streams a two-chunk chat reply after delay and counts requests and peak concurrency.
type fakeEngine struct {
	*httptest.Server
	delay    time.Duration
	status   atomic.Int64
	served   atomic.Int64
	inflight atomic.Int64
	peak     atomic.Int64
}

func newFakeEngine(t *testing.T, delay time.Duration) *fakeEngine {
	e := &fakeEngine{delay: delay}
	e.status.Store(http.StatusOK)
	e.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		n := e.inflight.Add(1)
		defer e.inflight.Add(-1)
		for p := e.peak.Load(); n > p && !e.peak.CompareAndSwap(p, n); p = e.peak.Load() {
		}
		select {
		case <-time.After(e.delay):
		case <-r.Context().Done():
			return
		}
		e.served.Add(1)
		if st := int(e.status.Load()); st != http.StatusOK {
			http.Error(w, "no", st)
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprint(w, sse(`{"choices":[{"delta":{"content":"a"}}]}`)+sse(`{"choices":[{"delta":{"content":"b"}}]}`)+
			sse(`{"choices":[],"usage":{"completion_tokens":2}}`)+"data: [DONE]\n\n")
	}))
	t.Cleanup(e.Close)
	return e
}

func requests(n int) []Request {
	rs := make([]Request, n)
	for i := range rs {
		rs[i] = Request{Prompt: Prompt{InputLen: 3, OutputLen: 2}, Body: []byte(`{}`)}
	}
	return rs
}

func TestScheduleIsPoissonAtTheAskedRate(t *testing.T) {
	for _, rate := range []float64{5, 50, 2000} {
		const n = 20000
		at := Schedule(rand.New(rand.NewPCG(1, 2)), n, rate)
		if at[0] != 0 {
			t.Fatalf("first request at %v, want 0", at[0])
		}
		got := float64(n-1) / at[n-1].Seconds()
		if math.Abs(got-rate)/rate > 0.05 {
			t.Errorf("rate %v: schedule gives %.2f req/s", rate, got)
		}
		// Exponential gaps have a standard deviation equal to their mean.
		var sum, sq float64
		for i := 1; i < n; i++ {
			g := (at[i] - at[i-1]).Seconds()
			sum += g
			sq += g * g
		}
		mean := sum / (n - 1)
		std := math.Sqrt(sq/(n-1) - mean*mean)
		if math.Abs(std-mean)/mean > 0.05 {
			t.Errorf("rate %v: gap std %.5f vs mean %.5f, not exponential", rate, std, mean)
		}
	}
	for _, burst := range []float64{math.Inf(1), 0} {
		for _, a := range Schedule(rand.New(rand.NewPCG(1, 2)), 10, burst) {
			if a != 0 {
				t.Fatalf("a burst sends everything at 0, got %v", a)
			}
		}
	}
}

// TestRunKeepsTheScheduleInRealTime is the one wall-clock check: requests must go out within 5 %
// of the asked rate.
func TestRunKeepsTheScheduleInRealTime(t *testing.T) {
	e := newFakeEngine(t, 0)
	s := NewSender(SenderConfig{BaseURL: e.URL, Backend: OpenAIChat})
	defer s.Close()
	// Four seconds of sending, so that a late wake-up of tens of ms on a loaded machine stays
	// well inside 5 %.
	const n, rate = 100, 25
	at := Schedule(rand.New(rand.NewPCG(3, 4)), n, rate)
	o, err := Run(context.Background(), RunConfig{Sender: s, Requests: requests(n), At: at})
	if err != nil {
		t.Fatal(err)
	}
	if len(o.Results) != n || o.Partial || o.Sent != n {
		t.Fatalf("%d results, partial %v, sent %d", len(o.Results), o.Partial, o.Sent)
	}
	// The achieved rate is the slope of actual send times over scheduled ones. A fit over every
	// request, rather than the last one alone, does not let one late wake-up on a loaded machine
	// decide the result.
	var sx, sy, sxx, sxy float64
	for i, r := range o.Results {
		x, y := at[i].Seconds(), r.Start.Sub(o.Results[0].Start).Seconds()
		sx, sy, sxx, sxy = sx+x, sy+y, sxx+x*x, sxy+x*y
	}
	slope := (n*sxy - sx*sy) / (n*sxx - sx*sx)
	if got := rate / slope; math.Abs(got-rate)/rate > 0.05 {
		t.Errorf("sent at %.1f req/s, asked for %d", got, rate)
	}
	if o.Duration < at[n-1] {
		t.Errorf("duration %v shorter than the schedule %v", o.Duration, at[n-1])
	}
}

func TestRunCapsConcurrency(t *testing.T) {
	e := newFakeEngine(t, 20*time.Millisecond)
	s := NewSender(SenderConfig{BaseURL: e.URL, Backend: OpenAIChat})
	defer s.Close()
	o, err := Run(context.Background(), RunConfig{Sender: s, Requests: requests(24), At: make([]time.Duration, 24), MaxConcurrency: 4})
	if err != nil {
		t.Fatal(err)
	}
	// Never above the cap; reaching it exactly depends on the scheduler of a loaded machine.
	if p := e.peak.Load(); p > 4 || p < 2 {
		t.Errorf("peak concurrency at the server %d, want at most 4", p)
	}
	m := Compute(o.Results, o.Duration, SLO{})
	if m.Completed != 24 || m.Concurrency > 4.01 || m.Concurrency < 2 {
		t.Errorf("completed %d, achieved concurrency %.2f", m.Completed, m.Concurrency)
	}
}

func TestRunWarmsUpFirst(t *testing.T) {
	e := newFakeEngine(t, 0)
	s := NewSender(SenderConfig{BaseURL: e.URL, Backend: OpenAIChat})
	defer s.Close()
	o, err := Run(context.Background(), RunConfig{Sender: s, Requests: requests(5), At: make([]time.Duration, 5), Warmup: 3})
	if err != nil {
		t.Fatal(err)
	}
	if len(o.Results) != 5 || e.served.Load() != 8 {
		t.Errorf("%d measured, %d served; want 5 measured after 3 warm-ups", len(o.Results), e.served.Load())
	}
	e.status.Store(http.StatusInternalServerError)
	if _, err := Run(context.Background(), RunConfig{Sender: s, Requests: requests(5), At: make([]time.Duration, 5), Warmup: 2}); err == nil {
		t.Error("a run whose warm-up requests all fail must not start")
	}
}

// TestRunStopsOnCancel is the Ctrl-C path: cancelling stops sending, aborts what is in flight and
// returns what finished, marked partial.
func TestRunStopsOnCancel(t *testing.T) {
	e := newFakeEngine(t, 5*time.Millisecond)
	s := NewSender(SenderConfig{BaseURL: e.URL, Backend: OpenAIChat})
	defer s.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	const n = 1000
	p := StartProgress(io.Discard, false, n)
	go func() {
		for p.done.Load() < 5 && ctx.Err() == nil {
			time.Sleep(time.Millisecond)
		}
		cancel()
	}()
	start := time.Now()
	o, err := Run(ctx, RunConfig{Sender: s, Requests: requests(n), At: Schedule(rand.New(rand.NewPCG(1, 1)), n, 50), Progress: p})
	p.Stop()
	if err != nil {
		t.Fatal(err)
	}
	if !o.Partial || o.Sent >= n || len(o.Results) < 5 || len(o.Results) > o.Sent {
		t.Fatalf("partial %v, sent %d, %d results", o.Partial, o.Sent, len(o.Results))
	}
	for _, r := range o.Results {
		if r.Err != "" {
			t.Errorf("a result of kind %q was kept", r.Err)
		}
	}
	if o.Duration <= 0 || o.Duration > time.Since(start) {
		t.Errorf("duration %v", o.Duration)
	}
	if m := Compute(o.Results, o.Duration, SLO{}); m.Completed != len(o.Results) || m.Failed != 0 {
		t.Errorf("partial metrics: %+v", m)
	}
}

func TestRunReplaysATraceAtItsTimestamps(t *testing.T) {
	ps, err := ReadTrace(seeded(), strings.NewReader(`{"timestamp":500,"input_len":2,"output_len":2}
{"timestamp":800,"input_len":2,"output_len":2}
{"timestamp":1100,"input_len":2,"output_len":2}`), 10, 2)
	if err != nil {
		t.Fatal(err)
	}
	rs, err := BuildRequests(OpenAIChat, ps, BodyOptions{Model: "m", Stream: true})
	if err != nil {
		t.Fatal(err)
	}
	at := TraceSchedule(rs)
	if !slices.Equal(at, msList(0, 150, 300)) {
		t.Fatalf("schedule %v, want the timestamps halved", at)
	}
	e := newFakeEngine(t, 0)
	s := NewSender(SenderConfig{BaseURL: e.URL, Backend: OpenAIChat})
	defer s.Close()
	o, err := Run(context.Background(), RunConfig{Sender: s, Requests: rs, At: at})
	if err != nil || len(o.Results) != 3 {
		t.Fatalf("%v, %d results", err, len(o.Results))
	}
	// Only a lower bound: a loaded machine may send late, but never early. The slack covers the
	// first request's own dispatch delay, since offsets are measured from its start.
	for i, r := range o.Results {
		if off := r.Start.Sub(o.Results[0].Start); off < at[i]-50*time.Millisecond {
			t.Errorf("request %d sent at +%v, before its time +%v", i, off, at[i])
		}
	}
}
