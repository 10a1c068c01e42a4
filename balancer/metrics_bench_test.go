package balancer

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

// BenchmarkMetricsSelected is the per-request cost of counting a selection.
func BenchmarkMetricsSelected(b *testing.B) {
	met, err := NewMetrics(prometheus.NewRegistry())
	if err != nil {
		b.Fatal(err)
	}
	w := testWorkers(1)[0]
	w.ModelID = "meta-llama/Llama-3.1-8B-Instruct"
	b.ReportAllocs()
	for b.Loop() {
		met.Selected(w, "cache_aware")
	}
}
