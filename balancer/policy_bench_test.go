package balancer

import (
	"fmt"
	"net/http"
	"runtime"
	"strings"
	"testing"
)

// benchRequests are chat-like prompts: 32 system prompts × distinct user turns.
func benchRequests(n int) []*Request {
	reqs := make([]*Request, n)
	for i := range reqs {
		sys := fmt.Sprintf("System %d: you are a careful assistant. %s", i%32, strings.Repeat("Rules. ", 20))
		header := http.Header{}
		header.Set(HeaderRoutingKey, fmt.Sprintf("session-%d", i))
		reqs[i] = &Request{
			Text:   sys + fmt.Sprintf("User: question number %d about topic %d?", i, i*31),
			Header: header,
		}
	}
	return reqs
}

// firstPolicy is the baseline: the cost of the harness and an interface call.
type firstPolicy struct{}

func (firstPolicy) Name() string    { return "baseline" }
func (firstPolicy) NeedsText() bool { return false }
func (firstPolicy) Select(ws []*Worker, _ *Request) (*Worker, error) {
	return ws[0], nil
}

// BenchmarkSelect is selection alone (no metrics) per policy and pool size.
func BenchmarkSelect(b *testing.B) {
	reqs := benchRequests(1024)
	for _, name := range append([]string{"baseline"}, PolicyNames(true)...) {
		for _, n := range []int{4, 64, 256} {
			b.Run(fmt.Sprintf("%s/workers=%d", name, n), func(b *testing.B) {
				var p Policy = firstPolicy{}
				if name != "baseline" {
					p, _ = NewPolicy(name, PolicyOptions{})
				}
				ws := testWorkers(n)
				for i, r := range reqs { // warm trees, rings and key maps
					p.Select(ws, r)
					ws[i%n].IncLoad()
				}
				b.ReportAllocs()
				i := 0
				for b.Loop() {
					if _, err := p.Select(ws, reqs[i&1023]); err != nil {
						b.Fatal(err)
					}
					i++
				}
			})
		}
	}
}

// BenchmarkRadixMatch is the prefix lookup alone on a warm tree.
func BenchmarkRadixMatch(b *testing.B) {
	reqs := benchRequests(1024)
	tr := newRadixTree(1 << 26)
	for i, r := range reqs {
		tr.insert(r.Text, uint32(i%8))
	}
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		if n, _ := tr.match(reqs[i&1023].Text); n == 0 {
			b.Fatal("no match")
		}
		i++
	}
}

// BenchmarkRadixBytesPerPrompt reports the tree's memory per cached prompt:
// its own estimate and the heap growth measured by the runtime.
func BenchmarkRadixBytesPerPrompt(b *testing.B) {
	const n = 100_000
	reqs := benchRequests(n)
	for b.Loop() {
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		tr := newRadixTree(1 << 30)
		for i, r := range reqs {
			tr.insert(r.Text, uint32(i%8))
		}
		runtime.GC()
		runtime.ReadMemStats(&after)
		b.ReportMetric(float64(tr.bytes)/n, "est-B/prompt")
		b.ReportMetric(float64(after.HeapAlloc-before.HeapAlloc)/n, "heap-B/prompt")
		b.ReportMetric(float64(len(reqs[n-1].Text)), "B-prompt-len")
		runtime.KeepAlive(tr)
	}
}
