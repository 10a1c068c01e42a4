package router_test

// End-to-end tests of --dp-aware (issue 12 item 1) through the real router
// binary against real mockworkers: each engine's DP ranks become workers
// named URL@RANK, every policy picks among them, and the rank reaches the
// engine as SGLang reads it: data_parallel_rank in regular mode (as
// sglang-router 0.3.x), routed_dp_rank on both PD legs and
// disagg_prefill_dp_rank on decode (as smg's pd_router.rs). Helpers are
// prefixed "dp".

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/pdrouter/pdrouter/mock/mockworker"
)

// dpListed is a worker as GET /workers lists it.
type dpListed struct {
	ID        string `json:"id"`
	URL       string `json:"url"`
	IsHealthy bool   `json:"is_healthy"`
	DPBaseURL string `json:"dp_base_url"`
	DPRank    *int   `json:"dp_rank"`
	DPSize    int    `json:"dp_size"`
}

// dpWorkers waits until the router lists n workers and returns them.
func dpWorkers(t *testing.T, r router, n int) []dpListed {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		var list struct {
			Workers []dpListed `json:"workers"`
		}
		getJSON(t, r.url+"/workers", &list)
		if len(list.Workers) == n {
			return list.Workers
		}
		if time.Now().After(deadline) {
			t.Fatalf("router lists %d workers, want %d: %+v", len(list.Workers), n, list.Workers)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func dpReset(t *testing.T, ws ...worker) {
	t.Helper()
	for _, w := range ws {
		if resp, _ := post(t, w.URL()+"/_mock/reset", ""); resp.StatusCode != http.StatusNoContent {
			t.Fatalf("reset %s: %d", w.URL(), resp.StatusCode)
		}
	}
}

// dpInt reads a recorded rank field: -1 when absent.
func dpInt(t *testing.T, raw json.RawMessage) int {
	t.Helper()
	if raw == nil {
		return -1
	}
	n, err := strconv.Atoi(string(raw))
	if err != nil {
		t.Fatalf("rank field %s is not an integer", raw)
	}
	return n
}

// dpPrompt is the text of request i: n (at most 26) prompts that share no
// prefix, so that cache_aware sees no cache hit between them.
func dpPrompt(i, n int) string { return string(rune('A'+i%n)) + ": a prompt of the dp test" }

var dpPolicies = []string{"round_robin", "random", "power_of_two", "cache_aware", "consistent_hashing", "prefix_hash", "manual"}

// Every policy routes among ranks, and each request tells its engine the
// rank chosen as data_parallel_rank: engine a has 2 ranks, b 3 (read from
// /get_server_info: it has no /server_info), c reports no dp_size and is
// one rank.
func TestDPAwareRegularEveryPolicy(t *testing.T) {
	t.Parallel()
	engines := map[string]worker{
		"a": startWorker(t, "regular", "--worker-id", "a", "--dp-size", "2", "--tokens", "1"),
		"b": startWorker(t, "regular", "--worker-id", "b", "--dp-size", "3", "--no-server-info", "--tokens", "1"),
		"c": startWorker(t, "regular", "--worker-id", "c", "--dp-size", "4", "--no-dp-size", "--tokens", "1"),
	}
	sizes := map[string]int{"a": 2, "b": 3, "c": 1}
	const distinct, total = 24, 48
	for _, policy := range dpPolicies {
		t.Run(policy, func(t *testing.T) {
			dpReset(t, engines["a"], engines["b"], engines["c"])
			r := startRouter(t, "--dp-aware", "--policy", policy, "--worker-urls", engines["a"].URL(), engines["b"].URL(), engines["c"].URL())
			listed := dpWorkers(t, r, 6)
			var urls []string
			for _, w := range listed {
				urls = append(urls, w.URL)
			}
			for id, e := range engines {
				for rank := range sizes[id] {
					if !slices.Contains(urls, fmt.Sprintf("%s@%d", e.URL(), rank)) {
						t.Fatalf("%s@%d not listed: %v", e.URL(), rank, urls)
					}
				}
			}
			for i := range total {
				text := dpPrompt(i, distinct)
				path, body := "/generate", `{"text":"`+text+`","sampling_params":{"max_new_tokens":1}}`
				if i%2 == 1 {
					path, body = "/v1/chat/completions", `{"model":"mock","messages":[{"role":"user","content":"`+text+`"}],"max_tokens":1}`
				}
				balPick(t, r.url+path, body, "X-SMG-Routing-Key", "key-"+strconv.Itoa(i%distinct))
			}
			perRank := map[string]int{}       // "a@1" -> requests
			byPrompt := map[string][]string{} // prompt -> rank-workers it went to
			for id, e := range engines {
				for _, rec := range e.requests(t) {
					rank := dpInt(t, rec.DataParallelRank)
					if rank < 0 || rank >= sizes[id] || rec.DPRank != rank || rec.RoutedDPRank != nil || rec.DisaggPrefillDPRank != nil {
						t.Fatalf("engine %s (%d ranks) got data_parallel_rank %s routed %s disagg %s", id, sizes[id],
							rec.DataParallelRank, rec.RoutedDPRank, rec.DisaggPrefillDPRank)
					}
					name := id + "@" + strconv.Itoa(rank)
					perRank[name]++
					for j := range distinct {
						if p := dpPrompt(j, distinct); strings.Contains(rec.Body, `"`+p+`"`) {
							byPrompt[p] = append(byPrompt[p], name)
						}
					}
				}
			}
			n := 0
			for _, c := range perRank {
				n += c
			}
			if n != total {
				t.Fatalf("engines recorded %d requests, want %d: %v", n, total, perRank)
			}
			switch policy {
			case "round_robin":
				for id := range engines {
					for rank := range sizes[id] {
						if got := perRank[id+"@"+strconv.Itoa(rank)]; got != total/6 {
							t.Errorf("round robin: %s@%d got %d, want %d (%v)", id, rank, got, total/6, perRank)
						}
					}
				}
			case "cache_aware", "consistent_hashing", "prefix_hash", "manual":
				for p, where := range byPrompt {
					if len(slices.Compact(slices.Sorted(slices.Values(where)))) != 1 {
						t.Errorf("%s: %q went to %v, want one rank-worker", policy, p, where)
					}
				}
			}
			// Ranks are workers: the policy spreads over more of them than
			// there are engines.
			if len(perRank) <= len(engines) {
				t.Errorf("%s used only %v", policy, perRank)
			}
		})
	}
}

// PD mode: prefill's rank as routed_dp_rank on the prefill leg; decode's as
// routed_dp_rank and prefill's as disagg_prefill_dp_rank on the decode leg,
// with the same bootstrap room on both, for every policy (bucket on the
// prefill side only).
func TestDPAwarePDEveryPolicy(t *testing.T) {
	t.Parallel()
	p := startWorker(t, "prefill", "--worker-id", "p", "--dp-size", "2")
	// Decode waits a little, as a real one waits for the KV: a reply done
	// before prefill is sent cuts the prefill leg short.
	d := startWorker(t, "decode", "--worker-id", "d", "--dp-size", "3", "--tokens", "1", "--prefill-delay", "20ms")
	const distinct, total = 24, 36
	policies := append([]string{"bucket"}, dpPolicies...)
	for _, policy := range policies {
		t.Run(policy, func(t *testing.T) {
			dpReset(t, p, d)
			args := []string{"--dp-aware", "--pd-disaggregation", "--prefill", p.URL(), "8998", "--decode", d.URL()}
			if policy == "bucket" {
				args = append(args, "--prefill-policy", "bucket", "--decode-policy", "round_robin")
			} else {
				args = append(args, "--policy", policy)
			}
			r := startRouter(t, args...)
			dpWorkers(t, r, 5)
			for i := range total {
				body := `{"text":"` + dpPrompt(i, distinct) + `","sampling_params":{"max_new_tokens":1}` + map[bool]string{true: `,"stream":true`}[i%3 == 0] + `}`
				balPick(t, r.url+"/generate", body, "X-SMG-Routing-Key", "key-"+strconv.Itoa(i%distinct))
			}
			// Decode answers without waiting for prefill's reply: wait for them.
			p.waitStats(t, 10*time.Second, "every prefill leg answered", func(s mockworker.Stats) bool { return s.Completed == total })
			prefillRank := map[string]int{} // bootstrap_room -> prefill's routed rank
			prefillUsed, decodeUsed := map[int]int{}, map[int]int{}
			for _, rec := range p.requests(t) {
				rank := dpInt(t, rec.RoutedDPRank)
				if rank < 0 || rank >= 2 || rec.DisaggPrefillDPRank != nil || rec.DataParallelRank != nil || rec.DPRank != rank {
					t.Fatalf("prefill leg: routed %s disagg %s data_parallel %s", rec.RoutedDPRank, rec.DisaggPrefillDPRank, rec.DataParallelRank)
				}
				prefillRank[string(rec.BootstrapRoom)] = rank
				prefillUsed[rank]++
			}
			decodes := d.requests(t)
			if len(decodes) != total || len(prefillRank) != total {
				t.Fatalf("%d decode legs, %d distinct prefill rooms; want %d", len(decodes), len(prefillRank), total)
			}
			for _, rec := range decodes {
				rank, from := dpInt(t, rec.RoutedDPRank), dpInt(t, rec.DisaggPrefillDPRank)
				want, ok := prefillRank[string(rec.BootstrapRoom)]
				if rank < 0 || rank >= 3 || rec.DataParallelRank != nil || !ok || from != want {
					t.Fatalf("decode leg: routed %s disagg %s (prefill rank of room %s: %d, %v)",
						rec.RoutedDPRank, rec.DisaggPrefillDPRank, rec.BootstrapRoom, want, ok)
				}
				decodeUsed[rank]++
			}
			if policy == "round_robin" && (prefillUsed[0] != total/2 || decodeUsed[0] != total/3 || decodeUsed[2] != total/3) {
				t.Errorf("round robin: prefill ranks %v, decode ranks %v", prefillUsed, decodeUsed)
			}
			if policy != "bucket" && (len(prefillUsed) < 2 || len(decodeUsed) < 2) {
				t.Errorf("%s: prefill ranks %v, decode ranks %v: want ranks as workers", policy, prefillUsed, decodeUsed)
			}
		})
	}
}

// The listing endpoints show the ranks as sglang-router and smg do, loads
// are per rank, and an engine's base URL removes all its ranks.
func TestDPAwareWorkerListings(t *testing.T) {
	t.Parallel()
	a := startWorker(t, "regular", "--dp-size", "2", "--prefill-delay", "1h")
	b := startWorker(t, "regular", "--no-dp-size")
	r := startRouter(t, "--dp-aware", "--policy", "round_robin", "--worker-urls", a.URL(), b.URL())
	listed := dpWorkers(t, r, 3)
	want := []string{a.URL() + "@0", a.URL() + "@1", b.URL() + "@0"}
	var got []string
	for _, w := range listed {
		got = append(got, w.URL)
		base, _, _ := strings.Cut(w.URL, "@")
		if w.DPBaseURL != base || w.DPRank == nil || w.URL != fmt.Sprintf("%s@%d", base, *w.DPRank) || !w.IsHealthy {
			t.Errorf("listed %+v", w)
		}
		if size := map[bool]int{true: 2, false: 1}[base == a.URL()]; w.DPSize != size {
			t.Errorf("%s: dp_size %d, want %d", w.URL, w.DPSize, size)
		}
	}
	if !slices.Equal(slices.Sorted(slices.Values(got)), slices.Sorted(slices.Values(want))) {
		t.Fatalf("/workers %v, want %v", got, want)
	}
	var legacy struct {
		URLs []string `json:"urls"`
	}
	getJSON(t, r.url+"/list_workers", &legacy)
	if !slices.Equal(slices.Sorted(slices.Values(legacy.URLs)), slices.Sorted(slices.Values(want))) {
		t.Errorf("/list_workers %v, want %v", legacy.URLs, want)
	}

	// One request in flight on a's rank 1 (3 prompt tokens + 2 to come).
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		req, _ := http.NewRequestWithContext(ctx, "POST", a.URL()+"/generate",
			strings.NewReader(`{"text":"a b c","sampling_params":{"max_new_tokens":2},"routed_dp_rank":1}`))
		if resp, err := client.Do(req); err == nil {
			resp.Body.Close()
		}
	}()
	a.waitStats(t, 5*time.Second, "a request on rank 1", func(s mockworker.Stats) bool { return len(s.RankRequests) == 2 && s.RankRequests[1] == 1 })
	var loads struct {
		Loads []struct {
			Worker string `json:"worker"`
			Load   int64  `json:"load"`
		} `json:"loads"`
	}
	getJSON(t, r.url+"/get_loads", &loads)
	perWorker := map[string]int64{}
	for _, l := range loads.Loads {
		perWorker[l.Worker] = l.Load
	}
	if len(perWorker) != 3 || perWorker[a.URL()+"@1"] != 5 || perWorker[a.URL()+"@0"] != 0 || perWorker[b.URL()+"@0"] != 0 {
		t.Errorf("/get_loads %v: want a@1 5, the others 0", perWorker)
	}
	cancel()

	// A rank by its id, then the engine by its URL.
	var one dpListed
	getJSON(t, r.url+"/workers/"+listed[1].ID, &one)
	if one.URL != listed[1].URL {
		t.Errorf("GET /workers/%s = %+v", listed[1].ID, one)
	}
	if resp, body := send(t, "DELETE", r.url+"/workers/"+url.PathEscape(a.URL()), ""); resp.StatusCode != 202 {
		t.Fatalf("DELETE engine a: %d %s", resp.StatusCode, body)
	}
	if left := dpWorkers(t, r, 1); left[0].URL != b.URL()+"@0" {
		t.Errorf("after removing a: %+v", left)
	}
}

// Without --dp-aware nothing changes: one worker per engine, bodies as sent.
func TestDPAwareOffLeavesWorkersAndBodies(t *testing.T) {
	t.Parallel()
	e := startWorker(t, "regular", "--dp-size", "4", "--tokens", "1")
	r := startRouter(t, "--policy", "round_robin", "--worker-urls", e.URL())
	if ws := dpWorkers(t, r, 1); ws[0].URL != e.URL() || ws[0].DPRank != nil || ws[0].DPSize != 0 {
		t.Fatalf("listed %+v", ws[0])
	}
	balPick(t, r.url+"/generate", `{"text":"x","sampling_params":{"max_new_tokens":1}}`)
	if recs := e.requests(t); len(recs) != 1 || strings.Contains(recs[0].Body, "rank") {
		t.Errorf("body %s", recs[0].Body)
	}
}

// Each rank has its own breaker: a sick rank is shut out while its
// engine's other rank keeps serving, and both stay healthy (probes go to
// the engine, which is up).
func TestDPAwareRankBreakersIndependent(t *testing.T) {
	t.Parallel()
	e := startWorker(t, "regular", "--dp-size", "2", "--fail-dp-rank", "1", "--tokens", "1")
	r := startRouter(t, "--dp-aware", "--policy", "round_robin", "--disable-retries", "--worker-urls", e.URL(),
		"--cb-failure-threshold", "2", "--cb-timeout-duration-secs", "600", "--health-check-interval-secs", "1")
	dpWorkers(t, r, 2)
	body := `{"text":"x","sampling_params":{"max_new_tokens":1}}`
	failed := 0
	for range 4 { // round robin: rank 1 fails twice, then its breaker is open
		if resp, _ := post(t, r.url+"/generate", body); resp.StatusCode != 200 {
			failed++
		}
	}
	if failed != 2 {
		t.Fatalf("%d of 4 failed, want rank 1's 2", failed)
	}
	dpReset(t, e)
	for range 6 {
		balPick(t, r.url+"/generate", body)
	}
	for _, rec := range e.requests(t) {
		if rec.DPRank != 0 {
			t.Errorf("a request reached rank %d after its breaker opened", rec.DPRank)
		}
	}
	time.Sleep(1500 * time.Millisecond) // a health check round
	for _, w := range dpWorkers(t, r, 2) {
		if !w.IsHealthy {
			t.Errorf("%s unhealthy: its engine answers /health", w.URL)
		}
	}
	for rank, want := range map[int]float64{0: 0, 1: 1} {
		if v, ok := balMetric(t, r, "smg_worker_cb_state", fmt.Sprintf(`worker="%s@%d"`, e.URL(), rank)); !ok || v != want {
			t.Errorf("cb state of rank %d = %v (%v), want %v", rank, v, ok, want)
		}
	}
}
