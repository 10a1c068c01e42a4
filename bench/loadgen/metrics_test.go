package loadgen

import (
	"math"
	"testing"
	"time"
)

func near(a, b float64) bool { return math.Abs(a-b) < 1e-6 }

func TestSummarizeMatchesNumpy(t *testing.T) {
	// numpy: a = arange(1, 11) → mean 5.5, median 5.5, std 2.8722813, p90 9.1, p95 9.55, p99 9.91.
	var ds []time.Duration
	for i := 10; i >= 1; i-- {
		ds = append(ds, msd(float64(i)))
	}
	s := summarize(ds)
	want := Summary{Mean: 5.5, Median: 5.5, Std: math.Sqrt(8.25), P90: 9.1, P95: 9.55, P99: 9.91, Max: 10}
	for _, c := range [][2]float64{{s.Mean, want.Mean}, {s.Median, want.Median}, {s.Std, want.Std},
		{s.P90, want.P90}, {s.P95, want.P95}, {s.P99, want.P99}, {s.Max, want.Max}} {
		if !near(c[0], c[1]) {
			t.Fatalf("got %+v, want %+v", s, want)
		}
	}
	if one := summarize(msList(4)); one != (Summary{Mean: 4, Median: 4, P90: 4, P95: 4, P99: 4, Max: 4}) {
		t.Errorf("one sample: %+v", one)
	}
	if (summarize(nil) != Summary{}) {
		t.Error("no samples must give zeros")
	}
}

func TestComputeCountsErrorsAndSkipsCancelled(t *testing.T) {
	rs := []Result{
		{InputLen: 10, OutputLen: 1, TTFT: msd(100), Latency: msd(100)},
		{InputLen: 10, OutputLen: 5, TTFT: msd(50), Latency: msd(450), ITL: msList(100, 100, 100, 100)},
		{InputLen: 99, Err: "http_503"},
		{InputLen: 99, Err: "http_503"},
		{InputLen: 99, Err: ErrTimeout},
		{InputLen: 99, Err: errCancelled},
	}
	m := Compute(rs, 4*time.Second, SLO{TPOT: msd(99)})
	if m.Completed != 2 || m.Failed != 3 || m.TotalInput != 20 || m.TotalOutput != 6 {
		t.Errorf("completed %d failed %d input %d output %d", m.Completed, m.Failed, m.TotalInput, m.TotalOutput)
	}
	if len(m.ErrorsByKind) != 2 || m.ErrorsByKind["http_503"] != 2 || m.ErrorsByKind[ErrTimeout] != 1 {
		t.Errorf("errors by kind %v", m.ErrorsByKind)
	}
	// TPOT is defined only for the 5-token request: (450−50)/4 = 100 ms, over the 99 ms SLO; the
	// 1-token request has TPOT 0 for goodput, so it is good.
	if m.TPOT.Mean != 100 || m.TPOT.Max != 100 || m.Good != 1 || !near(m.Goodput, 0.25) {
		t.Errorf("TPOT %+v good %d goodput %v", m.TPOT, m.Good, m.Goodput)
	}
	if !near(m.Concurrency, 0.55/4) || !near(m.RequestThroughput, 0.5) || !near(m.TotalThroughput, 26.0/4) {
		t.Errorf("concurrency %v throughput %v total %v", m.Concurrency, m.RequestThroughput, m.TotalThroughput)
	}
	if z := Compute(rs, 0, SLO{}); z.RequestThroughput != 0 || z.Good != 0 {
		t.Errorf("zero duration or no SLO: %+v", z)
	}
}

func TestPeakConcurrency(t *testing.T) {
	at := func(startMs, e2eMs float64) Result {
		return Result{Start: epoch.Add(msd(startMs)), Latency: msd(e2eMs)}
	}
	rs := []Result{
		at(0, 10), // [0, 10)
		at(5, 10), // [5, 15)
		at(10, 5), // [10, 15): starts as the first ends, so still 2 in flight
		at(12, 1), // [12, 13): 3 in flight
		at(50, 1), // alone
		{Start: epoch.Add(msd(11)), Err: "http_500"}, // failures are not counted
	}
	if got := Compute(rs, time.Second, SLO{}).PeakConcurrency; got != 3 {
		t.Errorf("peak %d, want 3", got)
	}
}
