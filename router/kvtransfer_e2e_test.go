package router_test

import (
	"math"
	"testing"
	"time"

	"github.com/pdrouter/pdrouter/mock/mockworker"
)

// smg_pd_kv_transfer_duration_seconds takes the KV transfer time a reply
// reports: decode's (pdrouter's KV sidecar engines), prefill's (SGLang
// computes it there), once per request when both report it, and not at all
// when neither does.
func TestPDKVTransferMetric(t *testing.T) {
	t.Parallel()
	labels := []string{`backend_type="pd"`, `model="mock"`, `runtime="sglang"`}
	for _, c := range []struct {
		name            string
		prefill, decode []string
		wantSum         float64 // seconds, over the two requests
	}{
		{"decode reports", nil, []string{"--report-transfer-ms", "40"}, 0.080},
		{"prefill reports", []string{"--report-transfer-ms", "25"}, nil, 0.050},
		{"both report", []string{"--report-transfer-ms", "25", "--prefill-delay", "500ms"}, []string{"--report-transfer-ms", "40"}, 0.080},
		{"neither", nil, nil, 0},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			p := startWorker(t, "prefill", c.prefill...)
			d := startWorker(t, "decode", append([]string{"--tokens", "3"}, c.decode...)...)
			r := pd(t, []worker{p}, []worker{d})
			for _, body := range []string{`{"text":"a b","model":"mock"}`, `{"text":"a b","model":"mock","stream":true}`} {
				if resp, b := post(t, r.url+"/generate", body); resp.StatusCode != 200 {
					t.Fatalf("%d %s", resp.StatusCode, b)
				}
			}
			// Prefill's reply may come after decode's went out: wait for both legs.
			p.waitStats(t, 10*time.Second, "prefill done", func(s mockworker.Stats) bool { return s.InFlight == 0 && s.Requests == 2 })
			want := 2.0
			if c.wantSum == 0 {
				want = 0
			}
			var n float64
			for range 100 {
				if n = max(sample(t, r.metrics, "smg_pd_kv_transfer_duration_seconds_count", labels...), 0); n == want {
					break
				}
				time.Sleep(20 * time.Millisecond)
			}
			if n != want {
				t.Fatalf("smg_pd_kv_transfer_duration_seconds_count = %v, want %v", n, want)
			}
			if s := max(sample(t, r.metrics, "smg_pd_kv_transfer_duration_seconds_sum", labels...), 0); math.Abs(s-c.wantSum) > 1e-9 {
				t.Errorf("smg_pd_kv_transfer_duration_seconds_sum = %v, want %v", s, c.wantSum)
			}
		})
	}
}
