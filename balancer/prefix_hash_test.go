package balancer

import (
	"fmt"
	"strings"
	"testing"
)

func TestPrefixHashAffinityAndSpill(t *testing.T) {
	ws := testWorkers(4)
	p := NewPrefixHash(PolicyOptions{PrefixBytes: 64})
	prefix := strings.Repeat("shared system prompt ", 4) // longer than 64 bytes
	first, _ := p.Select(ws, &Request{Text: prefix + "tail A"})
	if w, _ := p.Select(ws, &Request{Text: prefix + "another tail"}); w != first {
		t.Fatal("same leading bytes went to a different worker")
	}
	seen := map[*Worker]bool{}
	for i := range 100 {
		w, _ := p.Select(ws, &Request{Text: fmt.Sprintf("prompt %d", i)})
		seen[w] = true
	}
	if len(seen) != 4 {
		t.Fatalf("distinct prefixes used %d of 4 workers", len(seen))
	}
	// Over the load bound, the hot prefix spills to the next worker.
	for range 10 {
		first.IncLoad()
	}
	if w, _ := p.Select(ws, &Request{Text: prefix}); w == first {
		t.Fatal("overloaded worker kept its prefix")
	}
}
