package loadgen

import (
	"bufio"
	"bytes"
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
)

func sampleOutcome() (*Outcome, Info) {
	o := &Outcome{Duration: 2 * time.Second, Sent: 3, Results: []Result{
		{InputLen: 4, OutputLen: 3, Start: epoch, TTFT: msd(10), Latency: msd(50), ITL: msList(20, 20)},
		{InputLen: 5, OutputLen: 2, Start: epoch.Add(time.Second), TTFT: msd(15), Latency: msd(30), ITL: msList(15)},
		{InputLen: 6, Start: epoch, Err: "http_429", Msg: "slow down"},
	}}
	info := Info{Backend: OpenAIChat, Dataset: "random", BaseURL: "http://x", Model: "m", RequestRate: math.Inf(1),
		NumPrompts: 3, SLO: SLO{TTFT: msd(12)}, DatasetArgs: map[string]any{"random_input_len": 5}}
	return o, info
}

func TestRecordUsesBenchServingKeys(t *testing.T) {
	o, info := sampleOutcome()
	m := Compute(o.Results, o.Duration, info.SLO)
	path := filepath.Join(t.TempDir(), "out.jsonl")
	for _, details := range []bool{false, true} {
		if err := AppendRecord(path, Record(info, o, m, details)); err != nil {
			t.Fatal(err)
		}
	}
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var lines []map[string]any
	for sc := bufio.NewScanner(f); sc.Scan(); {
		var rec map[string]any
		if err := json.Unmarshal(sc.Bytes(), &rec); err != nil {
			t.Fatalf("line %q: %v", sc.Text(), err)
		}
		lines = append(lines, rec)
	}
	if len(lines) != 2 {
		t.Fatalf("%d lines, want one per run", len(lines))
	}
	rec := lines[0]
	for _, k := range []string{"backend", "dataset_name", "request_rate", "max_concurrency", "duration", "completed",
		"total_input_tokens", "total_output_tokens", "request_throughput", "input_throughput", "output_throughput",
		"total_throughput", "concurrency", "peak_concurrency", "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p90_ttft_ms", "p99_ttft_ms",
		"max_ttft_ms", "mean_itl_ms", "median_itl_ms", "p95_itl_ms", "p99_itl_ms", "mean_tpot_ms", "median_tpot_ms",
		"p99_tpot_ms", "mean_e2e_latency_ms", "median_e2e_latency_ms", "p99_e2e_latency_ms", "request_goodput",
		"random_input_len", "errors_by_kind", "failed", "partial", "model_id"} {
		if _, ok := rec[k]; !ok {
			t.Errorf("missing key %q", k)
		}
	}
	if rec["completed"] != 2.0 || rec["request_rate"] != "inf" || rec["mean_ttft_ms"] != 12.5 || rec["duration"] != 2.0 ||
		rec["request_goodput"] != 0.5 || rec["errors_by_kind"].(map[string]any)["http_429"] != 1.0 {
		t.Errorf("values: %v", rec)
	}
	if _, ok := rec["ttfts"]; ok {
		t.Error("per-request arrays without --output-details")
	}
	d := lines[1]
	if len(d["ttfts"].([]any)) != 3 || d["itls"].([]any)[0].([]any)[1] != 0.02 || d["output_lens"].([]any)[1] != 2.0 ||
		d["errors"].([]any)[2] != "http_429: slow down" || d["errors"].([]any)[0] != "" || d["input_lens"].([]any)[2] != 6.0 {
		t.Errorf("details: %v", d)
	}
}

func TestPrintTable(t *testing.T) {
	o, info := sampleOutcome()
	o.Partial = true
	var b bytes.Buffer
	PrintTable(&b, info, o, Compute(o.Results, o.Duration, info.SLO))
	for _, want := range []string{`Serving Benchmark Result`, `Interrupted: +yes, after 3 of 3`, `Successful requests: +2 `,
		`http_429: +1 `, `Request goodput \(req/s\): +0.50 `, `Mean TTFT \(ms\): +12.50 `, `P99 ITL \(ms\): +20.00 `} {
		if !regexp.MustCompile(want).MatchString(b.String()) {
			t.Errorf("table lacks %q:\n%s", want, b.String())
		}
	}
}

func TestWritePlotIsSelfContained(t *testing.T) {
	o, info := sampleOutcome()
	info.BaseURL = "http://x/<script>"
	var b bytes.Buffer
	if err := WritePlot(&b, info, o); err != nil {
		t.Fatal(err)
	}
	page := b.String()
	if n := strings.Count(page, "<svg"); n != 6 {
		t.Errorf("%d charts, want 4 CDFs and 2 throughput plots", n)
	}
	for _, banned := range []string{"<script", "src=", "href=", "@import"} {
		if strings.Contains(page, banned) {
			t.Errorf("page contains %q: it must need nothing external", banned)
		}
	}
	if strings.Count(page, "<polyline") != 6 {
		t.Error("every chart should have a curve")
	}
}
