package balancer

import (
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"testing"
)

func TestCacheAwareSharedPrefixSticks(t *testing.T) {
	ws := testWorkers(4)
	ca := NewCacheAware(PolicyOptions{})
	system := strings.Repeat("You are a helpful assistant. ", 8)
	first, _ := ca.Select(ws, &Request{Text: system + "question 0"})
	for i := 1; i < 50; i++ {
		w, _ := ca.Select(ws, &Request{Text: system + fmt.Sprintf("question %d", i)})
		if w != first {
			t.Fatalf("request %d with the shared prefix went to %s, not %s", i, w.URL, first.URL)
		}
	}
}

// Misses at equal load rotate over the workers instead of piling on one.
func TestCacheAwareSpreadsMisses(t *testing.T) {
	ws := testWorkers(4)
	ca := NewCacheAware(PolicyOptions{})
	c := map[*Worker]int{}
	for i := range 40 {
		w, _ := ca.Select(ws, &Request{Text: fmt.Sprintf("%d unrelated prompt %d", i*7919, i)})
		c[w]++
	}
	for _, w := range ws {
		if c[w] != 10 {
			t.Fatalf("misses not spread evenly: %v", c)
		}
	}
	// Misses go to the least loaded worker when loads differ.
	for i, w := range ws {
		if i != 2 {
			w.IncLoad()
		}
	}
	if w, _ := ca.Select(ws, &Request{Text: "a brand new prompt"}); w != ws[2] {
		t.Fatalf("miss went to %s, not the least loaded", w.URL)
	}
}

func TestCacheAwareImbalanceOverridesCache(t *testing.T) {
	ws := testWorkers(2)
	ca := NewCacheAware(PolicyOptions{BalanceAbsThreshold: 4, BalanceRelThreshold: 1.5})
	text := strings.Repeat("abc", 100)
	w0, _ := ca.Select(ws, &Request{Text: text})
	for range 3 {
		w0.IncLoad() // 3 vs 0: within the absolute threshold
	}
	if w, _ := ca.Select(ws, &Request{Text: text}); w != w0 {
		t.Fatal("balanced pool ignored the cache")
	}
	for range 7 {
		w0.IncLoad() // 10 vs 0: imbalanced
	}
	if w, _ := ca.Select(ws, &Request{Text: text}); w == w0 {
		t.Fatal("imbalanced pool still followed the cache")
	}
}

func TestCacheAwareHitIgnoresGoneWorker(t *testing.T) {
	ws := testWorkers(3)
	ca := NewCacheAware(PolicyOptions{})
	text := strings.Repeat("xyz", 50)
	w, _ := ca.Select(ws, &Request{Text: text})
	rest := make([]*Worker, 0, 2)
	for _, x := range ws {
		if x != w {
			rest = append(rest, x)
		}
	}
	if got, _ := ca.Select(rest, &Request{Text: text}); got == w {
		t.Fatal("picked a worker that is not a candidate")
	}
}

func TestCacheAwareSweepsRemovedWorkers(t *testing.T) {
	reg := NewRegistry()
	ws := testWorkers(2)
	for _, w := range ws {
		reg.Add(w)
	}
	ca := NewCacheAware(PolicyOptions{})
	reg.OnChange(ca.WorkersChanged)
	for i := range 20 {
		ca.Select(ws, &Request{Text: fmt.Sprintf("%x: distinct prompt %d", hashString(fmt.Sprint(i)), i)})
	}
	before := ca.TreeBytes()
	reg.Remove(ws[0].URL)
	ca.sweep()
	after := ca.TreeBytes()
	if after >= before {
		t.Fatalf("sweep freed nothing: %d → %d bytes", before, after)
	}
	tr := (*ca.trees.Load())[""].tree
	if got := subtreeCost(&tr.root); got != tr.bytes {
		t.Fatalf("accounting drift after sweep: counted %d, tracked %d", got, tr.bytes)
	}
}

func TestRadixTreeMatchAndSplit(t *testing.T) {
	tr := newRadixTree(1 << 20)
	tr.insert("hello world", 1)
	tr.insert("hello there", 2)
	if n, node := tr.match("hello world!"); n != 11 || len(node.tenants) != 1 || node.tenants[0] != 1 {
		t.Fatalf("match hello world!: %d %v", n, node.tenants)
	}
	if n, node := tr.match("hello"); n != 5 || len(node.tenants) != 2 {
		t.Fatalf("shared prefix: %d %v", n, node.tenants)
	}
	if n, _ := tr.match("goodbye"); n != 0 {
		t.Fatalf("no match expected, got %d", n)
	}
	if got := subtreeCost(&tr.root); got != tr.bytes {
		t.Fatalf("counted %d bytes, tracked %d", got, tr.bytes)
	}
}

// Property: after a million distinct prompts the tree is within its byte
// bound, its accounting matches a recount, and recent prompts still match.
func TestRadixTreeByteBound(t *testing.T) {
	n := 1_000_000
	if testing.Short() {
		n = 100_000
	}
	const limit = 1 << 20
	tr := newRadixTree(limit)
	rng := rand.New(rand.NewPCG(1, 2))
	prefixes := make([]string, 64)
	for i := range prefixes {
		prefixes[i] = fmt.Sprintf("system prompt %d: %s", i, strings.Repeat("z", rng.IntN(64)))
	}
	buf := make([]byte, 0, 256)
	var last string
	for i := range n {
		buf = append(buf[:0], prefixes[rng.IntN(len(prefixes))]...)
		buf = strconv.AppendUint(append(buf, " user asks "...), rng.Uint64(), 36)
		buf = strconv.AppendInt(append(buf, ' '), int64(i), 10)
		last = string(buf)
		tr.insert(last, uint32(i%16))
		if tr.bytes > limit {
			t.Fatalf("after %d prompts: %d bytes > limit %d", i+1, tr.bytes, limit)
		}
	}
	if got := subtreeCost(&tr.root); got != tr.bytes {
		t.Fatalf("accounting drift: counted %d, tracked %d", got, tr.bytes)
	}
	if m, _ := tr.match(last); m != len(last) {
		t.Fatalf("most recent prompt evicted: matched %d of %d", m, len(last))
	}
}

// The model a request names is client input: names no worker serves share
// the default tree instead of each growing its own.
func TestCacheAwareUnservedModelsShareOneTree(t *testing.T) {
	ws := testWorkers(2)
	ws[1].ModelID = "served"
	ca := NewCacheAware(PolicyOptions{})
	for i := range 100 {
		ca.Select(ws, &Request{Text: "prompt " + strconv.Itoa(i), Model: "bogus-" + strconv.Itoa(i)})
	}
	ca.Select(ws, &Request{Text: "prompt", Model: "served"})
	if n := len(*ca.trees.Load()); n != 2 {
		t.Fatalf("%d trees after 100 unserved model names and one served: want 2 (default, served)", n)
	}
}

// Loads move while cache_aware reads them: the minimum it reports is
// always some worker's, so ties is never 0. Reading the first worker's
// load twice made it 0 when that load rose in between, and Select then
// divided by zero (a soak crashed the router after 16 minutes).
func TestLoadStatsUnderMovingLoads(t *testing.T) {
	moving := NewWorker("http://10.0.0.1:1", Regular, NoBootstrapPort)
	busy := NewWorker("http://10.0.0.2:1", Regular, NoBootstrapPort)
	for range 5 {
		busy.IncLoad()
	}
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			select {
			case <-stop:
				return
			default:
				moving.IncLoad()
				moving.DecLoad()
			}
		}
	}()
	defer func() { close(stop); <-done }()
	workers := []*Worker{moving, busy}
	for i := range 2_000_000 {
		lo, hi, ties := loadStats(workers)
		if ties < 1 || lo > hi || lo > 1 || hi != 5 {
			t.Fatalf("call %d: min %d, max %d, %d at the min", i, lo, hi, ties)
		}
	}
}
