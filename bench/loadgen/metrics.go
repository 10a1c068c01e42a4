package loadgen

import (
	"math"
	"slices"
	"time"
)

// Summary describes one latency distribution in milliseconds.
type Summary struct {
	Mean, Median, Std, P90, P95, P99, Max float64
}

// summarize computes mean, population standard deviation and percentiles with linear
// interpolation between closest ranks, as numpy (and so bench_serving) does.
func summarize(ds []time.Duration) Summary {
	if len(ds) == 0 {
		return Summary{}
	}
	ms := make([]float64, len(ds))
	sum := 0.0
	for i, d := range ds {
		ms[i] = float64(d) / float64(time.Millisecond)
		sum += ms[i]
	}
	slices.Sort(ms)
	mean := sum / float64(len(ms))
	sq := 0.0
	for _, v := range ms {
		sq += (v - mean) * (v - mean)
	}
	return Summary{
		Mean: mean, Std: math.Sqrt(sq / float64(len(ms))),
		Median: percentile(ms, 50), P90: percentile(ms, 90), P95: percentile(ms, 95), P99: percentile(ms, 99),
		Max: ms[len(ms)-1],
	}
}

// percentile of sorted values, numpy's default "linear" method.
func percentile(sorted []float64, p float64) float64 {
	pos := p / 100 * float64(len(sorted)-1)
	lo := int(pos)
	if lo+1 >= len(sorted) {
		return sorted[len(sorted)-1]
	}
	return sorted[lo] + (pos-float64(lo))*(sorted[lo+1]-sorted[lo])
}

// SLO holds --slo-ttft-ms and --slo-tpot-ms; zero means not set.
type SLO struct {
	TTFT, TPOT time.Duration
}

func (s SLO) set() bool { return s.TTFT > 0 || s.TPOT > 0 }

// Metrics is a run's outcome, defined as in sglang.bench_serving.
type Metrics struct {
	Completed, Failed       int
	TotalInput, TotalOutput int
	Duration                time.Duration
	// Throughputs are per second of Duration; TotalThroughput counts input and output tokens.
	RequestThroughput, InputThroughput, OutputThroughput, TotalThroughput float64
	// Concurrency is the achieved concurrency: the sum of E2E latencies over Duration.
	Concurrency float64
	// PeakConcurrency is the most completed requests that were in flight at one instant.
	PeakConcurrency int
	TTFT, ITL       Summary
	// TPOT is (E2E − TTFT) / (output tokens − 1), over requests with more than one output token.
	TPOT, E2E Summary
	// Good counts completed requests within every SLO set; Goodput is Good per second.
	Good         int
	Goodput      float64
	ErrorsByKind map[string]int
}

// Compute turns successful and failed results into Metrics. Cancelled requests are left out:
// they measure the interruption, not the server.
func Compute(results []Result, duration time.Duration, slo SLO) Metrics {
	m := Metrics{Duration: duration, ErrorsByKind: map[string]int{}}
	var ttfts, itls, tpots, e2es []time.Duration
	var latencySum time.Duration
	for i := range results {
		r := &results[i]
		switch r.Err {
		case "":
		case errCancelled:
			continue
		default:
			m.Failed++
			m.ErrorsByKind[r.Err]++
			continue
		}
		m.Completed++
		m.TotalInput += r.InputLen
		m.TotalOutput += r.OutputLen
		ttfts = append(ttfts, r.TTFT)
		e2es = append(e2es, r.Latency)
		itls = append(itls, r.ITL...)
		latencySum += r.Latency
		tpot := tpotOf(r)
		if r.OutputLen > 1 {
			tpots = append(tpots, tpot)
		}
		if slo.set() && (slo.TTFT == 0 || r.TTFT <= slo.TTFT) && (slo.TPOT == 0 || tpot <= slo.TPOT) {
			m.Good++
		}
	}
	m.TTFT, m.ITL, m.TPOT, m.E2E = summarize(ttfts), summarize(itls), summarize(tpots), summarize(e2es)
	m.PeakConcurrency = peakInFlight(results)
	if sec := duration.Seconds(); sec > 0 {
		m.RequestThroughput = float64(m.Completed) / sec
		m.InputThroughput = float64(m.TotalInput) / sec
		m.OutputThroughput = float64(m.TotalOutput) / sec
		m.TotalThroughput = float64(m.TotalInput+m.TotalOutput) / sec
		m.Concurrency = latencySum.Seconds() / sec
		m.Goodput = float64(m.Good) / sec
	}
	return m
}

// tpotOf is a request's time per output token after the first, 0 when it has one token or fewer.
func tpotOf(r *Result) time.Duration {
	if r.OutputLen <= 1 {
		return 0
	}
	return (r.Latency - r.TTFT) / time.Duration(r.OutputLen-1)
}

// peakInFlight sweeps the successful requests' [start, end) intervals for the largest overlap.
func peakInFlight(results []Result) int {
	type edge struct {
		t     time.Time
		delta int
	}
	edges := make([]edge, 0, 2*len(results))
	for i := range results {
		if r := &results[i]; r.Err == "" {
			edges = append(edges, edge{r.Start, 1}, edge{r.Start.Add(r.Latency), -1})
		}
	}
	// Ends sort before starts at the same instant: back-to-back requests do not overlap.
	slices.SortFunc(edges, func(a, b edge) int {
		if c := a.t.Compare(b.t); c != 0 {
			return c
		}
		return a.delta - b.delta
	})
	peak, n := 0, 0
	for _, e := range edges {
		n += e.delta
		peak = max(peak, n)
	}
	return peak
}
