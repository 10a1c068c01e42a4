package loadgen

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"slices"
	"strings"
	"time"
)

// Info describes a run for its report.
type Info struct {
	Backend        Backend
	Dataset        string
	BaseURL        string
	Model          string
	RequestRate    float64 // +Inf for a burst
	MaxConcurrency int     // 0 when not set
	NumPrompts     int
	SLO            SLO
	// DatasetArgs are the dataset's flags, reported under their bench_serving names
	// (random_input_len, gsp_num_groups, ...).
	DatasetArgs map[string]any
}

// Record builds the --output-file object with bench_serving's key names; durations are in ms
// except "duration" (s) and the per-request arrays (s), as there.
func Record(info Info, o *Outcome, m Metrics, details bool) map[string]any {
	rec := map[string]any{
		"date":                time.Now().Format("20060102-150405"),
		"backend":             string(info.Backend),
		"dataset_name":        info.Dataset,
		"base_url":            info.BaseURL,
		"model_id":            info.Model,
		"request_rate":        rateValue(info.RequestRate),
		"max_concurrency":     nilIfZero(info.MaxConcurrency),
		"num_prompts":         info.NumPrompts,
		"partial":             o.Partial,
		"duration":            m.Duration.Seconds(),
		"completed":           m.Completed,
		"failed":              m.Failed,
		"errors_by_kind":      m.ErrorsByKind,
		"total_input_tokens":  m.TotalInput,
		"total_output_tokens": m.TotalOutput,
		"request_throughput":  m.RequestThroughput,
		"input_throughput":    m.InputThroughput,
		"output_throughput":   m.OutputThroughput,
		"total_throughput":    m.TotalThroughput,
		"concurrency":         m.Concurrency,
		"peak_concurrency":    m.PeakConcurrency,
	}
	for k, v := range info.DatasetArgs {
		rec[k] = v
	}
	for name, s := range map[string]Summary{"e2e_latency": m.E2E, "ttft": m.TTFT, "tpot": m.TPOT, "itl": m.ITL} {
		rec["mean_"+name+"_ms"] = s.Mean
		rec["median_"+name+"_ms"] = s.Median
		rec["std_"+name+"_ms"] = s.Std
		rec["p90_"+name+"_ms"] = s.P90
		rec["p95_"+name+"_ms"] = s.P95
		rec["p99_"+name+"_ms"] = s.P99
		rec["max_"+name+"_ms"] = s.Max
	}
	if info.SLO.set() {
		rec["request_goodput"] = m.Goodput
		rec["slo_ttft_ms"] = ms(info.SLO.TTFT)
		rec["slo_tpot_ms"] = ms(info.SLO.TPOT)
	}
	if details {
		n := len(o.Results)
		in, out, ttfts, itls, errs := make([]int, n), make([]int, n), make([]float64, n), make([][]float64, n), make([]string, n)
		for i, r := range o.Results {
			in[i], out[i], ttfts[i] = r.InputLen, r.OutputLen, r.TTFT.Seconds()
			itls[i] = make([]float64, len(r.ITL))
			for j, d := range r.ITL {
				itls[i][j] = d.Seconds()
			}
			if r.Err != "" {
				errs[i] = r.Err + ": " + r.Msg
			}
		}
		rec["input_lens"], rec["output_lens"], rec["ttfts"], rec["itls"], rec["errors"] = in, out, ttfts, itls, errs
	}
	return rec
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// rateValue reports a burst as the string "inf": JSON has no infinity.
func rateValue(r float64) any {
	if math.IsInf(r, 1) || r <= 0 {
		return "inf"
	}
	return r
}

func nilIfZero(n int) any {
	if n == 0 {
		return nil
	}
	return n
}

// AppendRecord appends rec as one JSON line to path.
func AppendRecord(path string, rec map[string]any) error {
	b, err := json.Marshal(rec)
	if err != nil {
		return err
	}
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	if _, err := f.Write(append(b, '\n')); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// PrintTable writes the end-of-run table in bench_serving's layout.
func PrintTable(w io.Writer, info Info, o *Outcome, m Metrics) {
	line := func(k string, v any) {
		switch v := v.(type) {
		case float64:
			fmt.Fprintf(w, "%-40s %-10.2f\n", k+":", v)
		default:
			fmt.Fprintf(w, "%-40s %-10v\n", k+":", v)
		}
	}
	title := func(t, fill string) {
		pad := max(50-len(t)-2, 0)
		fmt.Fprintf(w, "%s %s %s\n", strings.Repeat(fill, pad/2), t, strings.Repeat(fill, pad-pad/2))
	}
	title("Serving Benchmark Result", "=")
	if o.Partial {
		line("Interrupted", fmt.Sprintf("yes, after %d of %d requests sent", o.Sent, info.NumPrompts))
	}
	line("Backend", info.Backend)
	line("Traffic request rate", rateValue(info.RequestRate))
	if info.MaxConcurrency > 0 {
		line("Max request concurrency", info.MaxConcurrency)
	} else {
		line("Max request concurrency", "not set")
	}
	line("Successful requests", m.Completed)
	line("Failed requests", m.Failed)
	kinds := make([]string, 0, len(m.ErrorsByKind))
	for k := range m.ErrorsByKind {
		kinds = append(kinds, k)
	}
	slices.Sort(kinds)
	for _, k := range kinds {
		line("  "+k, m.ErrorsByKind[k])
	}
	line("Benchmark duration (s)", m.Duration.Seconds())
	line("Total input tokens", m.TotalInput)
	line("Total generated tokens", m.TotalOutput)
	line("Request throughput (req/s)", m.RequestThroughput)
	if info.SLO.set() {
		line("Request goodput (req/s)", m.Goodput)
	}
	line("Input token throughput (tok/s)", m.InputThroughput)
	line("Output token throughput (tok/s)", m.OutputThroughput)
	line("Total token throughput (tok/s)", m.TotalThroughput)
	line("Concurrency", m.Concurrency)
	line("Peak concurrency", m.PeakConcurrency)
	for _, sec := range []struct {
		title, short string
		s            Summary
	}{
		{"End-to-End Latency", "E2E Latency", m.E2E},
		{"Time to First Token", "TTFT", m.TTFT},
		{"Time per Output Token (excl. 1st token)", "TPOT", m.TPOT},
		{"Inter-Token Latency", "ITL", m.ITL},
	} {
		title(sec.title, "-")
		line("Mean "+sec.short+" (ms)", sec.s.Mean)
		line("Median "+sec.short+" (ms)", sec.s.Median)
		line("P90 "+sec.short+" (ms)", sec.s.P90)
		line("P99 "+sec.short+" (ms)", sec.s.P99)
		line("Max "+sec.short+" (ms)", sec.s.Max)
	}
	fmt.Fprintln(w, strings.Repeat("=", 50))
}
