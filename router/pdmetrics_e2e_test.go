package router_test

import (
	"bufio"
	"strconv"
	"strings"
	"testing"
	"time"
)

// sample is the value of the series whose name and labels start as given
// (labels as they print, e.g. `model="mock"`), or -1 when absent.
func sample(t *testing.T, metricsURL, name string, labels ...string) float64 {
	t.Helper()
	_, body := get(t, metricsURL)
	sc := bufio.NewScanner(strings.NewReader(string(body)))
	for sc.Scan() {
		line := sc.Text()
		series, value, ok := strings.Cut(line, " ")
		if !ok || (series != name && !strings.HasPrefix(series, name+"{")) {
			continue
		}
		match := true
		for _, l := range labels {
			match = match && strings.Contains(series, l)
		}
		if match {
			v, err := strconv.ParseFloat(value, 64)
			if err != nil {
				t.Fatalf("%s: %v", line, err)
			}
			return v
		}
	}
	return -1
}

// The PD stage series move as a scripted deployment says: prefill takes
// 300 ms, decode's first byte 600 ms after it was sent.
func TestPDStageMetrics(t *testing.T) {
	t.Parallel()
	p := startWorker(t, "prefill", "--prefill-delay", "300ms")
	d := startWorker(t, "decode", "--prefill-delay", "600ms", "--tokens", "2")
	r := pd(t, []worker{p}, []worker{d})
	for _, body := range []string{`{"text":"a b","model":"mock"}`, `{"text":"a b","model":"mock","stream":true}`} {
		if resp, b := post(t, r.url+"/generate", body); resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, b)
		}
	}
	labels := []string{`backend_type="pd"`, `model="mock"`, `runtime="sglang"`}
	if n := sample(t, r.metrics, "smg_pd_ttft_seconds_count", labels...); n != 2 {
		t.Errorf("smg_pd_ttft_seconds_count = %v, want 2", n)
	}
	if s := sample(t, r.metrics, "smg_pd_ttft_seconds_sum", labels...); s < 2*0.6 || s > 2*0.6+1 {
		t.Errorf("smg_pd_ttft_seconds_sum = %v, want about 1.2", s)
	}
	// Prefill may answer after decode's reply went out (the router does not
	// wait for it): poll.
	var n float64
	for range 100 {
		if n = sample(t, r.metrics, "smg_pd_prefill_duration_seconds_count", labels...); n == 2 {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if n != 2 {
		t.Fatalf("smg_pd_prefill_duration_seconds_count = %v, want 2", n)
	}
	if s := sample(t, r.metrics, "smg_pd_prefill_duration_seconds_sum", labels...); s < 2*0.3 || s > 2*0.6 {
		t.Errorf("smg_pd_prefill_duration_seconds_sum = %v, want about 0.6", s)
	}
	if v := sample(t, r.metrics, "smg_pd_bootstrap_failures_total"); v != 0 {
		t.Errorf("bootstrap failures %v before any", v)
	}
	if resp, _ := post(t, r.url+"/generate", `["not","an","object"]`); resp.StatusCode != 400 {
		t.Fatalf("non-object body: %d", resp.StatusCode)
	}
	if v := sample(t, r.metrics, "smg_pd_bootstrap_failures_total"); v != 1 {
		t.Errorf("smg_pd_bootstrap_failures_total = %v, want 1", v)
	}
}
