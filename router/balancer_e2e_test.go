package router_test

// End-to-end tests of the balancer (issue 3) through the real router binary
// against real mockworkers: policy distributions in regular and PD mode,
// health gating, the circuit breaker, retries, admission and the worker
// admin API. Every helper here is prefixed "bal" so it cannot collide with
// helpers other files of the package add.

import (
	"bufio"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pdrouter/pdrouter/balancer"
	"github.com/pdrouter/pdrouter/mock/mockworker"
	"github.com/pdrouter/pdrouter/testkit/testenv"
)

// balPick sends one request that must succeed and returns the X-Worker-Id
// of the worker that answered (the decode worker in PD mode).
func balPick(t *testing.T, u, body string, header ...string) string {
	t.Helper()
	resp, out := post(t, u, body, header...)
	if resp.StatusCode != 200 {
		t.Fatalf("POST %s: status %d: %s", u, resp.StatusCode, out)
	}
	id := resp.Header.Get("X-Worker-Id")
	if id == "" {
		t.Fatalf("POST %s: no X-Worker-Id in %v", u, resp.Header)
	}
	return id
}

// balPDPick sends one PD request and returns which prefill served it (by the
// bootstrap port the decode leg received: pd() gives the first prefill 8998
// and the second "none", i.e. null) and the decode worker's id.
// balPD2x2 starts two prefills and two decodes (worker ids d1 and d2, one
// token each) behind a PD router with args, waits until all four are
// healthy, and returns the router and the decodes by worker id.
func balPD2x2(t *testing.T, args ...string) (router, map[string]worker) {
	t.Helper()
	p1, p2 := startWorker(t, "prefill"), startWorker(t, "prefill")
	d1, d2 := startWorker(t, "decode", "--worker-id", "d1", "--tokens", "1"), startWorker(t, "decode", "--worker-id", "d2", "--tokens", "1")
	r := pd(t, []worker{p1, p2}, []worker{d1, d2}, args...)
	for _, w := range []worker{p1, p2, d1, d2} {
		balWaitHealth(t, r, w.URL(), true, 10*time.Second)
	}
	return r, map[string]worker{"d1": d1, "d2": d2}
}

func balPDPick(t *testing.T, r router, decodes map[string]worker, path, body string, header ...string) (prefillPort, decodeID string) {
	t.Helper()
	decodeID = balPick(t, r.url+path, body, header...)
	d, ok := decodes[decodeID]
	if !ok {
		t.Fatalf("answer from unknown decode %q", decodeID)
	}
	reqs := d.requests(t) // requests are sequential: the last one is ours
	return string(reqs[len(reqs)-1].BootstrapPort), decodeID
}

func balCount(ids []string) map[string]int {
	m := map[string]int{}
	for _, id := range ids {
		m[id]++
	}
	return m
}

// balDistinct is a prompt sharing no leading characters with the others.
func balDistinct(i int) string {
	h := sha256.Sum256([]byte(strconv.Itoa(i)))
	return strings.Repeat(hex.EncodeToString(h[:]), 4)
}

// balWorkerInfo is the part of the /workers API's worker object the tests read.
type balWorkerInfo struct {
	ID         string            `json:"id"`
	URL        string            `json:"url"`
	Priority   uint32            `json:"priority"`
	Cost       float32           `json:"cost"`
	WorkerType string            `json:"worker_type"`
	IsHealthy  bool              `json:"is_healthy"`
	Load       int64             `json:"load"`
	Metadata   map[string]string `json:"metadata"`
	JobStatus  *struct {
		Status    string `json:"status"`
		WorkerURL string `json:"worker_url"`
	} `json:"job_status"`
}

func balList(t *testing.T, r router) []balWorkerInfo {
	t.Helper()
	var out struct {
		Workers []balWorkerInfo `json:"workers"`
		Total   int             `json:"total"`
	}
	getJSON(t, r.url+"/workers", &out)
	if out.Total != len(out.Workers) {
		t.Fatalf("GET /workers: total %d but %d workers", out.Total, len(out.Workers))
	}
	return out.Workers
}

// balGet reads GET /workers/{id or URL}.
func balGet(t *testing.T, r router, idOrURL string) (int, balWorkerInfo) {
	t.Helper()
	resp, body := get(t, r.url+"/workers/"+url.PathEscape(idOrURL))
	var wi balWorkerInfo
	if resp.StatusCode == 200 {
		if err := json.Unmarshal(body, &wi); err != nil {
			t.Fatalf("GET /workers/%s: %v: %s", idOrURL, err, body)
		}
	}
	return resp.StatusCode, wi
}

// balWaitHealth polls until the router reports the registered worker at u
// with the given health.
func balWaitHealth(t *testing.T, r router, u string, healthy bool, d time.Duration) {
	t.Helper()
	deadline := time.Now().Add(d)
	for {
		code, wi := balGet(t, r, u)
		if code == 200 && wi.JobStatus == nil && wi.IsHealthy == healthy {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("worker %s not registered with is_healthy=%v within %v (status %d, %+v)", u, healthy, d, code, wi)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// balMetric returns the value of the first sample of name whose labels
// contain every one of labels (`key="value"` strings).
func balMetric(t *testing.T, r router, name string, labels ...string) (float64, bool) {
	t.Helper()
	_, body := get(t, r.metrics)
	for line := range strings.SplitSeq(string(body), "\n") {
		rest, ok := strings.CutPrefix(line, name)
		if !ok || (rest != "" && rest[0] != '{' && rest[0] != ' ') {
			continue
		}
		all := true
		for _, l := range labels {
			all = all && strings.Contains(rest, l)
		}
		if !all {
			continue
		}
		v, err := strconv.ParseFloat(rest[strings.LastIndexByte(rest, ' ')+1:], 64)
		if err != nil {
			t.Fatalf("metric line %q: %v", line, err)
		}
		return v, true
	}
	return 0, false
}

// balConcurrent runs n requests from conc goroutines and returns the
// X-Worker-Id of each (errors are reported, their ids left empty).
func balConcurrent(t *testing.T, u, body string, n, conc int) []string {
	t.Helper()
	ids := make([]string, n)
	var wg sync.WaitGroup
	next := make(chan int, n)
	for i := range n {
		next <- i
	}
	close(next)
	for range conc {
		wg.Go(func() {
			for i := range next {
				resp, err := client.Post(u, "application/json", strings.NewReader(body))
				if err != nil {
					t.Errorf("request %d: %v", i, err)
					continue
				}
				out, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				if resp.StatusCode != 200 {
					t.Errorf("request %d: status %d: %s", i, resp.StatusCode, out)
					continue
				}
				ids[i] = resp.Header.Get("X-Worker-Id")
			}
		})
	}
	wg.Wait()
	return ids
}

// --- 1. Policy distributions ------------------------------------------------

func TestBalancerRoundRobinRegular(t *testing.T) {
	t.Parallel()
	a, b, c := startWorker(t, "regular", "--worker-id", "a"), startWorker(t, "regular", "--worker-id", "b"),
		startWorker(t, "regular", "--worker-id", "c")
	r := startRouter(t, "--worker-urls", a.URL(), b.URL(), c.URL(), "--policy", "round_robin")
	// Readiness needs only one worker: wait until all three take traffic.
	for _, w := range []worker{a, b, c} {
		balWaitHealth(t, r, w.URL(), true, 10*time.Second)
	}
	var ids []string
	for range 12 {
		ids = append(ids, balPick(t, r.url+"/generate", `{"text":"hi","sampling_params":{"max_new_tokens":1}}`))
	}
	// Exact rotation: a period of 3 covering the three workers.
	if ids[0] == ids[1] || ids[1] == ids[2] || ids[0] == ids[2] {
		t.Fatalf("first three requests not on three workers: %v", ids)
	}
	for i := 3; i < len(ids); i++ {
		if ids[i] != ids[i-3] {
			t.Fatalf("round robin broke at request %d: %v", i, ids)
		}
	}
}

func TestBalancerRoundRobinPD(t *testing.T) {
	t.Parallel()
	r, decodes := balPD2x2(t)
	var prefills, decs []string
	for range 8 {
		p, d := balPDPick(t, r, decodes, "/generate", `{"text":"hi"}`)
		prefills, decs = append(prefills, p), append(decs, d)
	}
	// Each side has its own counter: both alternate exactly.
	for i := 1; i < 8; i++ {
		if prefills[i] == prefills[i-1] || decs[i] == decs[i-1] {
			t.Fatalf("PD round robin not alternating: prefills %v decodes %v", prefills, decs)
		}
	}
	if n := balCount(prefills); n["8998"] != 4 || n["null"] != 4 {
		t.Errorf("prefill split %v, want 4/4", n)
	}
}

func TestBalancerRandomRegular(t *testing.T) {
	t.Parallel()
	a, b := startWorker(t, "regular", "--worker-id", "a"), startWorker(t, "regular", "--worker-id", "b")
	r := startRouter(t, "--worker-urls", a.URL(), b.URL(), "--policy", "random")
	balWaitHealth(t, r, a.URL(), true, 10*time.Second)
	balWaitHealth(t, r, b.URL(), true, 10*time.Second)
	const n = 200
	ids := balConcurrent(t, r.url+"/generate", `{"text":"hi","sampling_params":{"max_new_tokens":1}}`, n, 4)
	counts := balCount(ids)
	// Binomial(200, 0.5): 35–65 % is about 4.2 standard deviations each way.
	for _, id := range []string{"a", "b"} {
		if counts[id] < n*35/100 || counts[id] > n*65/100 {
			t.Errorf("random over 2 workers: %v, want each in 35–65 %%", counts)
		}
	}
}

func TestBalancerRandomPD(t *testing.T) {
	t.Parallel()
	r, decodes := balPD2x2(t, "--prefill-policy", "random", "--decode-policy", "random")
	const n = 200
	ids := balConcurrent(t, r.url+"/generate", `{"text":"hi"}`, n, 4)
	// Which prefill served each request, from what the decodes recorded.
	ports := map[string]int{}
	for _, d := range decodes {
		for _, rq := range d.requests(t) {
			ports[string(rq.BootstrapPort)]++
		}
	}
	for name, counts := range map[string]map[string]int{"decode": balCount(ids), "prefill": ports} {
		if len(counts) != 2 {
			t.Errorf("%s side: %v, want two workers", name, counts)
		}
		for k, c := range counts {
			if c < n*35/100 || c > n*65/100 {
				t.Errorf("%s side: %s got %d of %d (%v), want 35–65 %%", name, k, c, n, counts)
			}
		}
	}
}

// balPowerOfTwo checks that the slow worker got clearly fewer of the
// concurrent requests than the fast one.
func balPowerOfTwo(t *testing.T, ids []string, slow, fast string) {
	t.Helper()
	c := balCount(ids)
	if c[slow]+c[fast] != len(ids) {
		t.Fatalf("unexpected workers: %v", c)
	}
	// Random choice would give about half each; picking the less loaded
	// keeps the slow worker at a small share.
	if c[slow]*3 > c[fast] {
		t.Errorf("power_of_two: slow worker got %d, fast %d: want slow < fast/3", c[slow], c[fast])
	}
}

func TestBalancerPowerOfTwoRegular(t *testing.T) {
	t.Parallel()
	fast := startWorker(t, "regular", "--worker-id", "fast")
	slow := startWorker(t, "regular", "--worker-id", "slow", "--prefill-delay", "400ms")
	// A 1 s /get_load poll, so engine-reported loads are mixed in as well.
	r := startRouter(t, "--worker-urls", fast.URL(), slow.URL(), "--policy", "power_of_two", "--worker-startup-check-interval", "1")
	balWaitHealth(t, r, fast.URL(), true, 10*time.Second)
	balWaitHealth(t, r, slow.URL(), true, 10*time.Second)
	ids := balConcurrent(t, r.url+"/generate", `{"text":"some prompt words","sampling_params":{"max_new_tokens":2}}`, 48, 6)
	balPowerOfTwo(t, ids, "slow", "fast")
}

func TestBalancerPowerOfTwoPD(t *testing.T) {
	t.Parallel()
	p := startWorker(t, "prefill")
	fast := startWorker(t, "decode", "--worker-id", "fast", "--tokens", "2")
	slow := startWorker(t, "decode", "--worker-id", "slow", "--tokens", "2", "--prefill-delay", "400ms")
	r := pd(t, []worker{p}, []worker{fast, slow}, "--decode-policy", "power_of_two", "--worker-startup-check-interval", "1")
	for _, w := range []worker{p, fast, slow} {
		balWaitHealth(t, r, w.URL(), true, 10*time.Second)
	}
	ids := balConcurrent(t, r.url+"/v1/completions", `{"model":"mock","prompt":"some prompt words"}`, 48, 6)
	balPowerOfTwo(t, ids, "slow", "fast")
}

// balSharedPrefix is a long common prefix (a system prompt).
var balSharedPrefix = strings.Repeat("You are a careful assistant that answers in short sentences. ", 10)

func TestBalancerCacheAwareRegular(t *testing.T) {
	t.Parallel()
	a, b := startWorker(t, "regular", "--worker-id", "a", "--tokens", "1"), startWorker(t, "regular", "--worker-id", "b", "--tokens", "1")
	r := startRouter(t, "--worker-urls", a.URL(), b.URL(), "--policy", "cache_aware")
	balWaitHealth(t, r, a.URL(), true, 10*time.Second)
	balWaitHealth(t, r, b.URL(), true, 10*time.Second)
	var shared, distinct []string
	for i := range 12 { // interleaved, so misses happen between the hits
		shared = append(shared, balPick(t, r.url+"/generate", fmt.Sprintf(`{"text":%q}`, balSharedPrefix+"question "+strconv.Itoa(i))))
		distinct = append(distinct, balPick(t, r.url+"/generate", fmt.Sprintf(`{"text":%q}`, balDistinct(i))))
	}
	if c := balCount(shared); len(c) != 1 {
		t.Errorf("shared-prefix requests spread over %v, want one worker", c)
	}
	// Misses go to the least-loaded worker, ties rotated: not all to one.
	if c := balCount(distinct); c["a"] < 3 || c["b"] < 3 {
		t.Errorf("distinct prompts: %v, want both workers used", c)
	}
}

func TestBalancerCacheAwarePD(t *testing.T) {
	t.Parallel()
	r, decodes := balPD2x2(t, "--prefill-policy", "cache_aware", "--decode-policy", "cache_aware")
	chat := func(system, user string) string {
		return fmt.Sprintf(`{"model":"mock","messages":[{"role":"system","content":%q},{"role":"user","content":%q}]}`, system, user)
	}
	var sharedP, sharedD, distinctP, distinctD []string
	for i := range 10 {
		p, d := balPDPick(t, r, decodes, "/v1/chat/completions", chat(balSharedPrefix, "question "+strconv.Itoa(i)))
		sharedP, sharedD = append(sharedP, p), append(sharedD, d)
		p, d = balPDPick(t, r, decodes, "/v1/chat/completions", chat(balDistinct(i), "x"))
		distinctP, distinctD = append(distinctP, p), append(distinctD, d)
	}
	if cp, cd := balCount(sharedP), balCount(sharedD); len(cp) != 1 || len(cd) != 1 {
		t.Errorf("shared prefix spread: prefills %v decodes %v, want one of each", cp, cd)
	}
	if cp, cd := balCount(distinctP), balCount(distinctD); len(cp) != 2 || len(cd) != 2 {
		t.Errorf("distinct prompts: prefills %v decodes %v, want both of each side used", cp, cd)
	}
}

// X-SMG-Target-Worker names the same worker on a retry: an attempt that
// failed on the pinned worker does not shift the index onto another one.
func TestTargetWorkerStaysPinnedOnRetry(t *testing.T) {
	t.Parallel()
	var urls []string
	byID := map[string]string{}
	for _, id := range []string{"a", "b", "c"} { // each fails its first request
		byID[id] = startWorker(t, "regular", "--worker-id", id, "--tokens", "1", "--fail-first-n", "1").URL()
		urls = append(urls, byID[id])
	}
	r := startRouter(t, append(append([]string{"--worker-urls"}, urls...), "--policy", "consistent_hashing",
		"--retry-initial-backoff-ms", "1", "--retry-max-backoff-ms", "5")...)
	for _, u := range urls {
		balWaitHealth(t, r, u, true, 10*time.Second)
	}
	_, list := get(t, r.url+"/workers")
	var ws struct{ Workers []balWorkerInfo }
	if err := json.Unmarshal(list, &ws); err != nil || len(ws.Workers) != 3 {
		t.Fatalf("GET /workers: %v %s", err, list)
	}
	pinned := ws.Workers[1].URL
	resp, out := post(t, r.url+"/generate", `{"text":"hi"}`, "X-SMG-Target-Worker", "1")
	if resp.StatusCode != 200 {
		t.Fatalf("pinned request: %d %s, want 200 from %s on the retry", resp.StatusCode, out, pinned)
	}
	if got := resp.Header.Get("X-Worker-Id"); byID[got] != pinned {
		t.Fatalf("answered by %s (%s), want the worker at index 1, %s", got, byID[got], pinned)
	}
}

func TestBalancerConsistentHashing(t *testing.T) {
	t.Parallel()
	ws := map[string]worker{}
	var urls []string
	for _, id := range []string{"a", "b", "c"} {
		ws[id] = startWorker(t, "regular", "--worker-id", id, "--tokens", "1")
		urls = append(urls, ws[id].URL())
	}
	r := startRouter(t, append(append([]string{"--worker-urls"}, urls...), "--policy", "consistent_hashing",
		"--retry-initial-backoff-ms", "1", "--retry-max-backoff-ms", "5")...)
	for _, u := range urls {
		balWaitHealth(t, r, u, true, 10*time.Second)
	}
	const body = `{"text":"hi"}`
	route := func() map[string]string {
		m := map[string]string{}
		for k := range 24 {
			key := "session-" + strconv.Itoa(k)
			m[key] = balPick(t, r.url+"/generate", body, "X-SMG-Routing-Key", key)
		}
		return m
	}
	before := route()
	if again := route(); fmt.Sprint(again) != fmt.Sprint(before) {
		t.Fatalf("same routing keys moved:\n%v\n%v", before, again)
	}
	if used := balCount(valuesOf(before)); len(used) < 2 {
		t.Errorf("24 keys all on %v", used)
	}
	// An implicit key (Authorization) is sticky too.
	first := balPick(t, r.url+"/generate", body, "Authorization", "Bearer user-7")
	for range 5 {
		if got := balPick(t, r.url+"/generate", body, "Authorization", "Bearer user-7"); got != first {
			t.Fatalf("implicit key moved from %s to %s", first, got)
		}
	}
	// X-SMG-Target-Worker pins an index of the available list.
	pinned := map[string]bool{}
	for i := range 3 {
		id := balPick(t, r.url+"/generate", body, "X-SMG-Target-Worker", strconv.Itoa(i))
		for range 3 {
			if got := balPick(t, r.url+"/generate", body, "X-SMG-Target-Worker", strconv.Itoa(i)); got != id {
				t.Fatalf("target worker %d answered by %s then %s", i, id, got)
			}
		}
		pinned[id] = true
	}
	if len(pinned) != 3 {
		t.Errorf("target indexes 0..2 reached %v, want three workers", pinned)
	}
	resp, out := post(t, r.url+"/generate", body, "X-SMG-Target-Worker", "3")
	if resp.StatusCode != 503 || decodeError(t, out).Error.Code != "server_selection_failed" {
		t.Errorf("target out of range: %d %s", resp.StatusCode, out)
	}

	// Removing a worker moves only its keys; adding it back restores the map.
	victim := ws["c"]
	if resp, out := send(t, "DELETE", r.url+"/workers/"+url.PathEscape(victim.URL()), ""); resp.StatusCode != 202 {
		t.Fatalf("DELETE: %d %s", resp.StatusCode, out)
	}
	after := route()
	for k, id := range before {
		if id != "c" && after[k] != id {
			t.Errorf("key %s moved from %s to %s when c was removed", k, id, after[k])
		}
		if after[k] == "c" {
			t.Errorf("key %s still routed to removed worker c", k)
		}
	}
	if resp, out := post(t, r.url+"/workers", `{"url":"`+victim.URL()+`"}`); resp.StatusCode != 202 {
		t.Fatalf("POST /workers: %d %s", resp.StatusCode, out)
	}
	balWaitHealth(t, r, victim.URL(), true, 10*time.Second)
	if back := route(); fmt.Sprint(back) != fmt.Sprint(before) {
		t.Errorf("after re-adding c the keys did not return:\nbefore %v\nafter  %v", before, back)
	}
}

func valuesOf(m map[string]string) []string {
	var out []string
	for _, v := range m {
		out = append(out, v)
	}
	return out
}

func TestBalancerManualStickyKeys(t *testing.T) {
	t.Parallel()
	a, b := startWorker(t, "regular", "--worker-id", "a", "--tokens", "1"), startWorker(t, "regular", "--worker-id", "b", "--tokens", "1")
	r := startRouter(t, "--worker-urls", a.URL(), b.URL(), "--policy", "manual", "--assignment-mode", "min_group")
	balWaitHealth(t, r, a.URL(), true, 10*time.Second)
	balWaitHealth(t, r, b.URL(), true, 10*time.Second)
	const body = `{"text":"hi"}`
	k1 := balPick(t, r.url+"/generate", body, "X-SMG-Routing-Key", "k1")
	k2 := balPick(t, r.url+"/generate", body, "X-SMG-Routing-Key", "k2")
	if k1 == k2 {
		t.Errorf("min_group put both new keys on %s", k1)
	}
	for range 5 {
		for key, want := range map[string]string{"k1": k1, "k2": k2} {
			if got := balPick(t, r.url+"/generate", body, "X-SMG-Routing-Key", key); got != want {
				t.Fatalf("key %s moved from %s to %s", key, want, got)
			}
		}
	}
	// Keyless requests still go anywhere.
	if c := balCount(balConcurrent(t, r.url+"/generate", body, 40, 2)); len(c) != 2 {
		t.Errorf("keyless requests: %v, want both workers", c)
	}
}

// Per-side key policies in PD mode: consistent hashing on prefill, manual on decode.
func TestBalancerKeyPoliciesPD(t *testing.T) {
	t.Parallel()
	r, decodes := balPD2x2(t, "--prefill-policy", "consistent_hashing", "--decode-policy", "manual")
	prefillsUsed := map[string]bool{}
	for k := range 12 {
		key := "conv-" + strconv.Itoa(k)
		p0, d0 := balPDPick(t, r, decodes, "/generate", `{"text":"hi"}`, "X-SMG-Routing-Key", key)
		prefillsUsed[p0] = true
		for range 3 {
			if p, d := balPDPick(t, r, decodes, "/generate", `{"text":"hi"}`, "X-SMG-Routing-Key", key); p != p0 || d != d0 {
				t.Fatalf("key %s moved: prefill %s→%s decode %s→%s", key, p0, p, d0, d)
			}
		}
	}
	if len(prefillsUsed) != 2 {
		t.Errorf("12 keys hashed to prefills %v, want both", prefillsUsed)
	}
}

// --- 2. Health gating ---------------------------------------------------------

// balRestartOn starts a mockworker on a port a stopped one used.
func balRestartOn(t *testing.T, addr string, args ...string) worker {
	t.Helper()
	_, port, _ := net.SplitHostPort(addr)
	deadline := time.Now().Add(5 * time.Second)
	for { // the port is free once the old process is gone; make sure before starting
		ln, err := net.Listen("tcp", addr)
		if err == nil {
			ln.Close()
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("port %s not free again: %v", addr, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	return startWorker(t, "regular", append([]string{"--port", port}, args...)...)
}

func TestBalancerHealthGatingKillAndRevive(t *testing.T) {
	t.Parallel()
	a, b := startWorker(t, "regular", "--worker-id", "a", "--tokens", "1"), startWorker(t, "regular", "--worker-id", "b", "--tokens", "1")
	r := startRouter(t, "--worker-urls", a.URL(), b.URL(), "--policy", "round_robin",
		"--health-check-interval-secs", "1", "--health-failure-threshold", "1", "--health-success-threshold", "1",
		"--health-check-timeout-secs", "1", "--cb-timeout-duration-secs", "1", "--retry-initial-backoff-ms", "5")
	balWaitHealth(t, r, a.URL(), true, 10*time.Second)
	balWaitHealth(t, r, b.URL(), true, 10*time.Second)
	const body = `{"text":"hi"}`
	if c := balCount([]string{balPick(t, r.url+"/generate", body), balPick(t, r.url+"/generate", body)}); len(c) != 2 {
		t.Fatalf("both workers should take traffic first: %v", c)
	}

	b.Stop()
	// Until the checker notices, retries hide the dead worker: nothing fails.
	deadline := time.Now().Add(10 * time.Second)
	for {
		balPick(t, r.url+"/generate", body)
		if _, wi := balGet(t, r, b.URL()); !wi.IsHealthy {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("dead worker never marked unhealthy")
		}
		time.Sleep(20 * time.Millisecond)
	}
	for i := range 10 {
		if id := balPick(t, r.url+"/generate", body); id != "a" {
			t.Fatalf("request %d after detection went to %s", i, id)
		}
	}
	if rd, _ := get(t, r.url+"/readiness"); rd.StatusCode != 200 {
		t.Errorf("readiness %d with one healthy worker", rd.StatusCode)
	}

	// Bring it back on the same address: it gets traffic again.
	b2 := balRestartOn(t, b.Addr, "--worker-id", "b2", "--tokens", "1")
	balWaitHealth(t, r, b2.URL(), true, 10*time.Second)
	seen := map[string]int{}
	deadline = time.Now().Add(5 * time.Second) // the breaker may still be open for up to 1 s
	for seen["b2"] == 0 {
		seen[balPick(t, r.url+"/generate", body)]++
		if time.Now().After(deadline) {
			t.Fatalf("revived worker got no traffic: %v", seen)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func TestBalancerStartsWithWorkerDown(t *testing.T) {
	t.Parallel()
	addr := "127.0.0.1:" + strconv.Itoa(testenv.FreePort(t))
	u := "http://" + addr
	r := startRouterOpts(t, false, "--worker-urls", u, "--policy", "round_robin", "--worker-startup-check-interval", "1",
		"--retry-initial-backoff-ms", "1", "--retry-max-backoff-ms", "5")
	if resp, body := get(t, r.url+"/readiness"); resp.StatusCode != 503 {
		t.Errorf("readiness with the only worker down: %d %s", resp.StatusCode, body)
	}
	if ws := balList(t, r); len(ws) != 0 {
		t.Errorf("GET /workers lists a pending worker: %+v", ws)
	}
	code, wi := balGet(t, r, u)
	if code != 200 || wi.JobStatus == nil || wi.IsHealthy ||
		(wi.JobStatus.Status != "pending" && wi.JobStatus.Status != "processing") || wi.JobStatus.WorkerURL != u {
		t.Errorf("GET /workers/{url} of a pending worker: %d %+v %+v", code, wi, wi.JobStatus)
	}
	resp, out := post(t, r.url+"/generate", `{"text":"hi"}`)
	if resp.StatusCode != 503 || decodeError(t, out).Error.Code != "server_selection_failed" {
		t.Errorf("generate with no worker: %d %s", resp.StatusCode, out)
	}

	w := balRestartOn(t, addr, "--worker-id", "late")
	testenv.WaitStatus(t, r.url+"/readiness", 200, 10*time.Second)
	if id := balPick(t, r.url+"/generate", `{"text":"hi"}`); id != "late" {
		t.Errorf("answered by %s", id)
	}
	if ws := balList(t, r); len(ws) != 1 || ws[0].URL != w.URL() || !ws[0].IsHealthy || ws[0].JobStatus != nil {
		t.Errorf("GET /workers after registration: %+v", ws)
	}
}

// A worker whose probe fails while it keeps completing requests is busy,
// not dead: passive successes keep it in the pool. Once idle, it goes.
func TestBalancerBusyWorkerWithFailingProbeStays(t *testing.T) {
	t.Parallel()
	w := startWorker(t, "regular", "--worker-id", "busy", "--tokens", "1", "--health-fail-after", "1500ms")
	started := time.Now()
	r := startRouter(t, "--worker-urls", w.URL(), "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
		"--health-check-timeout-secs", "1", "--disable-retries")
	balWaitHealth(t, r, w.URL(), true, 10*time.Second)
	// Traffic through several failing probes.
	for time.Since(started) < 4500*time.Millisecond {
		if code, out := balStatus(t, r.url+"/generate"); code != 200 {
			t.Fatalf("busy worker with failing /health evicted after %v: %d %s", time.Since(started), code, out)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if code, _ := get(t, w.URL()+"/health"); code.StatusCode != 503 {
		t.Fatalf("mock /health answers %d, the test needs it failing", code.StatusCode)
	}
	balWaitHealth(t, r, w.URL(), false, 5*time.Second)
	if resp, body := get(t, r.url+"/readiness"); resp.StatusCode != 503 {
		t.Errorf("readiness with no healthy worker: %d %s", resp.StatusCode, body)
	}
}

func TestBalancerPendingWorkerAdmin(t *testing.T) {
	t.Parallel()
	up := startWorker(t, "regular", "--worker-id", "up")
	r := startRouter(t, "--worker-urls", up.URL(), "--worker-startup-check-interval", "1")
	// Duplicates are refused, registered or pending.
	if resp, out := post(t, r.url+"/workers", `{"url":"`+up.URL()+`"}`); resp.StatusCode != 409 {
		t.Errorf("POST of a registered URL: %d %s", resp.StatusCode, out)
	}
	addr := "127.0.0.1:" + strconv.Itoa(testenv.FreePort(t))
	resp, out := post(t, r.url+"/workers", `{"url":"http://`+addr+`"}`)
	var added struct {
		WorkerID string `json:"worker_id"`
	}
	if resp.StatusCode != 202 || json.Unmarshal(out, &added) != nil {
		t.Fatalf("POST /workers: %d %s", resp.StatusCode, out)
	}
	if resp, out := post(t, r.url+"/workers", `{"url":"http://`+addr+`"}`); resp.StatusCode != 409 {
		t.Errorf("POST of a pending URL: %d %s", resp.StatusCode, out)
	}
	code, wi := balGet(t, r, added.WorkerID)
	if code != 200 || wi.JobStatus == nil || wi.JobStatus.Status == "failed" || wi.IsHealthy {
		t.Errorf("pending worker: %d %+v", code, wi)
	}
	// Deleting it cancels the registration: when it comes up it is not added.
	if resp, out := send(t, "DELETE", r.url+"/workers/"+added.WorkerID, ""); resp.StatusCode != 202 {
		t.Fatalf("DELETE pending: %d %s", resp.StatusCode, out)
	}
	if code, _ := balGet(t, r, added.WorkerID); code != 404 {
		t.Errorf("GET after DELETE of a pending worker: %d", code)
	}
	late := balRestartOn(t, addr, "--worker-id", "late")
	// Give a (wrongly) surviving registration time to probe it twice.
	time.Sleep(2500 * time.Millisecond)
	if ws := balList(t, r); len(ws) != 1 || ws[0].URL != up.URL() {
		t.Errorf("cancelled registration came back: %+v", ws)
	}
	if n := late.stats(t).Requests; n != 0 {
		t.Errorf("cancelled worker got %d requests", n)
	}
}

// --- 3. Circuit breaker -------------------------------------------------------

// balStatus sends one request and returns its status and body.
func balStatus(t *testing.T, u string) (int, []byte) {
	t.Helper()
	resp, out := post(t, u, `{"text":"hi","sampling_params":{"max_new_tokens":1}}`)
	return resp.StatusCode, out
}

// balUntilNot503 polls with requests until one is not a 503.
func balUntilNot503(t *testing.T, u string, d time.Duration) (int, []byte) {
	t.Helper()
	deadline := time.Now().Add(d)
	for {
		code, out := balStatus(t, u)
		if code != 503 {
			return code, out
		}
		if time.Now().After(deadline) {
			t.Fatalf("still 503 after %v: %s", d, out)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func TestBalancerBreakerOpensAndHalfOpens(t *testing.T) {
	t.Parallel()
	w := startWorker(t, "regular", "--status-code", "500")
	r := startRouter(t, "--worker-urls", w.URL(), "--policy", "round_robin",
		"--cb-failure-threshold", "3", "--cb-timeout-duration-secs", "1", "--disable-retries")
	balWaitHealth(t, r, w.URL(), true, 10*time.Second)
	gen := r.url + "/generate"
	for i := range 3 {
		if code, out := balStatus(t, gen); code != 500 {
			t.Fatalf("request %d: %d %s, want the worker's 500", i, code, out)
		}
	}
	code, out := balStatus(t, gen)
	if e := decodeError(t, out); code != 503 || e.Error.Code != "server_selection_failed" {
		t.Fatalf("with the breaker open: %d %s", code, out)
	}
	if v, ok := balMetric(t, r, "smg_worker_cb_state", `worker="`+w.URL()+`"`); !ok || v != 1 {
		t.Errorf("smg_worker_cb_state = %v (found %v), want 1 (open)", v, ok)
	}
	if n := w.stats(t).Requests; n != 3 {
		t.Errorf("worker saw %d requests, want 3: an open breaker must not send any", n)
	}
	// After the timeout one request goes through (half-open); its failure
	// opens the breaker again at once.
	if code, out := balUntilNot503(t, gen, 5*time.Second); code != 500 {
		t.Fatalf("half-open request: %d %s", code, out)
	}
	if code, out := balStatus(t, gen); code != 503 {
		t.Errorf("after a half-open failure: %d %s, want 503", code, out)
	}
	if n := w.stats(t).Requests; n != 4 {
		t.Errorf("worker saw %d requests, want 4", n)
	}
	if v, _ := balMetric(t, r, "smg_worker_cb_transitions_total", `worker="`+w.URL()+`"`, `from="half_open"`, `to="open"`); v != 1 {
		t.Errorf("half_open→open transitions = %v, want 1", v)
	}
}

func TestBalancerBreakerCloses(t *testing.T) {
	t.Parallel()
	w := startWorker(t, "regular", "--fail-first-n", "3", "--worker-id", "w")
	r := startRouter(t, "--worker-urls", w.URL(), "--policy", "round_robin",
		"--cb-failure-threshold", "3", "--cb-success-threshold", "2", "--cb-timeout-duration-secs", "1", "--disable-retries")
	balWaitHealth(t, r, w.URL(), true, 10*time.Second)
	gen := r.url + "/generate"
	for range 3 {
		if code, out := balStatus(t, gen); code != 500 {
			t.Fatalf("%d %s, want 500", code, out)
		}
	}
	if code, out := balStatus(t, gen); code != 503 {
		t.Fatalf("breaker not open: %d %s", code, out)
	}
	if code, out := balUntilNot503(t, gen, 5*time.Second); code != 200 {
		t.Fatalf("half-open request: %d %s", code, out)
	}
	for i := range 5 {
		if code, out := balStatus(t, gen); code != 200 {
			t.Fatalf("request %d after recovery: %d %s", i, code, out)
		}
	}
	if v, ok := balMetric(t, r, "smg_worker_cb_state", `worker="`+w.URL()+`"`); !ok || v != 0 {
		t.Errorf("smg_worker_cb_state = %v (found %v), want 0 (closed)", v, ok)
	}
}

func TestBalancerBreakerPD(t *testing.T) {
	t.Parallel()
	p := startWorker(t, "prefill")
	d400 := startWorker(t, "decode", "--status-code", "400")
	d500 := startWorker(t, "decode", "--status-code", "500")
	flags := []string{"--cb-failure-threshold", "2", "--cb-timeout-duration-secs", "60", "--disable-retries"}
	r400 := pd(t, []worker{p}, []worker{d400}, flags...)
	r500 := pd(t, []worker{p}, []worker{d500}, flags...)
	balWaitHealth(t, r400, d400.URL(), true, 10*time.Second)
	balWaitHealth(t, r500, d500.URL(), true, 10*time.Second)
	// A decode 4xx is the client's fault: it never opens the breaker.
	for i := range 6 {
		if code, out := balStatus(t, r400.url+"/generate"); code != 400 {
			t.Fatalf("decode 400, request %d: %d %s", i, code, out)
		}
	}
	if n := d400.stats(t).Requests; n != 6 {
		t.Errorf("4xx decode saw %d requests, want 6", n)
	}
	// A decode 5xx does.
	for range 2 {
		if code, out := balStatus(t, r500.url+"/generate"); code != 500 {
			t.Fatalf("decode 500: %d %s", code, out)
		}
	}
	code, out := balStatus(t, r500.url+"/generate")
	if code != 503 || decodeError(t, out).Error.Code != "server_selection_failed" {
		t.Errorf("after 2 decode 500s: %d %s, want 503", code, out)
	}
	if n := d500.stats(t).Requests; n != 2 {
		t.Errorf("5xx decode saw %d requests, want 2", n)
	}
}

func TestBalancerBreakerDisabled(t *testing.T) {
	t.Parallel()
	w := startWorker(t, "regular", "--status-code", "500")
	r := startRouter(t, "--worker-urls", w.URL(), "--cb-failure-threshold", "3", "--disable-circuit-breaker", "--disable-retries")
	balWaitHealth(t, r, w.URL(), true, 10*time.Second)
	for i := range 6 {
		if code, out := balStatus(t, r.url+"/generate"); code != 500 || !strings.Contains(string(out), `"object":"error"`) {
			t.Fatalf("request %d: %d %s, want the worker's 500", i, code, out)
		}
	}
	if n := w.stats(t).Requests; n != 6 {
		t.Errorf("worker saw %d requests, want 6", n)
	}
}

// --- 4. Retries ---------------------------------------------------------------

func TestBalancerRetriesLandOnHealthyWorker(t *testing.T) {
	t.Parallel()
	bad := startWorker(t, "regular", "--worker-id", "bad", "--status-code", "500")
	good := startWorker(t, "regular", "--worker-id", "good", "--tokens", "1")
	common := []string{"--worker-urls", bad.URL(), good.URL(), "--policy", "round_robin"}
	r := startRouter(t, append(common, "--retry-initial-backoff-ms", "5")...)
	noRetry := startRouter(t, append(common, "--disable-retries")...)
	for _, rr := range []router{r, noRetry} {
		balWaitHealth(t, rr, bad.URL(), true, 10*time.Second)
		balWaitHealth(t, rr, good.URL(), true, 10*time.Second)
	}
	for i := range 8 {
		if id := balPick(t, r.url+"/generate", `{"text":"hi"}`); id != "good" {
			t.Fatalf("request %d answered by %s", i, id)
		}
	}
	// Streams too: the 500 comes before the first byte, so it is retried.
	for i := range 4 {
		resp, out := post(t, r.url+"/generate", `{"text":"hi","stream":true}`)
		if evs := sseEvents(out); resp.StatusCode != 200 || resp.Header.Get("X-Worker-Id") != "good" ||
			len(evs) < 2 || evs[len(evs)-1] != "[DONE]" {
			t.Fatalf("stream %d: %d from %q: %s", i, resp.StatusCode, resp.Header.Get("X-Worker-Id"), out)
		}
	}
	if n := bad.stats(t).Requests; n < 6 {
		t.Errorf("round robin sent the bad worker only %d first attempts", n)
	}
	if v, ok := balMetric(t, r, "smg_worker_retries_total"); !ok || v < 4 {
		t.Errorf("smg_worker_retries_total = %v (found %v), want ≥ 4", v, ok)
	}
	// Without retries the worker's 500 reaches the client.
	codes := map[int]int{}
	for range 4 {
		code, out := balStatus(t, noRetry.url+"/generate")
		codes[code]++
		if code == 500 && !strings.Contains(string(out), `"object":"error"`) {
			t.Errorf("500 body is not the worker's: %s", out)
		}
	}
	if codes[500] != 2 || codes[200] != 2 {
		t.Errorf("--disable-retries with round robin: %v, want two 500s and two 200s", codes)
	}
}

func TestBalancerRetriesPD(t *testing.T) {
	t.Parallel()
	bad := startWorker(t, "prefill", "--status-code", "500")
	good := startWorker(t, "prefill")
	// Decode waits a little before its first byte, as a real decode waits
	// for KV, so the prefill failure is usually seen before decode answers.
	d := startWorker(t, "decode", "--worker-id", "d", "--tokens", "2", "--prefill-delay", "150ms")
	r := pd(t, []worker{bad, good}, []worker{d}, "--retry-initial-backoff-ms", "5")
	for _, w := range []worker{bad, good, d} {
		balWaitHealth(t, r, w.URL(), true, 10*time.Second)
	}
	for i := range 6 {
		if code, out := balStatus(t, r.url+"/generate"); code != 200 {
			t.Fatalf("request %d: %d %s", i, code, out)
		}
	}
	if n := bad.stats(t).Requests; n < 3 {
		t.Fatalf("bad prefill saw %d requests, want ≥ 3", n)
	}
	// A failed prefill cancels its decode leg and the pair is retried; the
	// client sees only the retry's answer. (A decode that finishes before
	// the prefill failure arrives is simply the answer, so the counts are
	// bounded rather than exact.)
	d.waitStats(t, 5*time.Second, "decode legs settled", func(s mockworker.Stats) bool {
		return s.InFlight == 0 && s.Completed+s.ClientGone == s.Requests
	})
	ds := d.stats(t)
	retries, _ := balMetric(t, r, "smg_worker_retries_total", `worker_type="prefill"`)
	if ds.Completed < 6 || ds.ClientGone < 1 || retries < float64(ds.ClientGone) {
		t.Errorf("decode %+v, %v retries: want ≥ 6 completed, cancelled legs, each retried", ds, retries)
	}
	// Every attempt had its own room.
	rooms := map[string]bool{}
	for _, w := range []worker{bad, good} {
		for _, rq := range w.requests(t) {
			if rooms[string(rq.BootstrapRoom)] {
				t.Errorf("room %s reused across attempts", rq.BootstrapRoom)
			}
			rooms[string(rq.BootstrapRoom)] = true
		}
	}
}

// --- 5. Admission ---------------------------------------------------------------

// balAsync sends a request in the background.
type balResult struct {
	code    int
	body    []byte
	header  http.Header
	elapsed time.Duration
	err     error
}

func balAsync(u, body string) <-chan balResult {
	ch := make(chan balResult, 1)
	go func() {
		start := time.Now()
		resp, err := client.Post(u, "application/json", strings.NewReader(body))
		if err != nil {
			ch <- balResult{err: err}
			return
		}
		b, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		ch <- balResult{code: resp.StatusCode, body: b, header: resp.Header, elapsed: time.Since(start), err: err}
	}()
	return ch
}

// balCheckRejection accepts the spec's empty body (§5.5) or the router's
// OpenAI-shaped error with the given code.
func balCheckRejection(t *testing.T, res balResult, status int, code string) {
	t.Helper()
	if res.err != nil || res.code != status {
		t.Fatalf("got %d (%v) %s, want %d", res.code, res.err, res.body, status)
	}
	if len(res.body) == 0 {
		return
	}
	if e := decodeError(t, res.body); e.Error.Code != code || res.header.Get("X-SMG-Error-Code") != code {
		t.Errorf("%d body %s / X-SMG-Error-Code %q, want code %s", status, res.body, res.header.Get("X-SMG-Error-Code"), code)
	}
}

// As sglang-router 0.3.2 (measured): --queue-size does not bound the
// requests waiting for a token (its queue is a channel drained at once), so
// with a queue of 1 both later requests wait and are served in turn.
func TestBalancerAdmissionQueueDoesNotBoundWaiters(t *testing.T) {
	t.Parallel()
	w := startWorker(t, "regular", "--prefill-delay", "1s", "--tokens", "1")
	// A near-zero refill rate makes the bucket a pure concurrency limit, so
	// only releases hand out tokens.
	r := startRouter(t, "--worker-urls", w.URL(), "--max-concurrent-requests", "1", "--queue-size", "1",
		"--rate-limit-tokens-per-second", "0.001")
	const body = `{"text":"hi"}`
	first := balAsync(r.url+"/generate", body)
	w.waitStats(t, 5*time.Second, "first request in flight", func(s mockworker.Stats) bool { return s.InFlight == 1 })
	second, third := balAsync(r.url+"/generate", body), balAsync(r.url+"/generate", body)
	for i, ch := range []<-chan balResult{first, second, third} {
		if res := <-ch; res.code != 200 {
			t.Errorf("request %d: %d %s", i, res.code, res.body)
		}
	}
	if n := w.stats(t).Requests; n != 3 {
		t.Errorf("worker saw %d requests, want 3", n)
	}
}

// sglang-router 0.3.2, measured with its own test's settings: 1 token, 1
// token/s, queue 1, 1 s queue timeout, a 2 s worker, 4 requests at once:
// one 200 and three 408 (the refilled token lands on the waiters' deadline).
func TestBalancerAdmissionMatchesSglangRouter(t *testing.T) {
	t.Parallel()
	w := startWorker(t, "regular", "--prefill-delay", "2s", "--tokens", "1")
	r := startRouter(t, "--worker-urls", w.URL(), "--max-concurrent-requests", "1", "--queue-size", "1",
		"--queue-timeout-secs", "1", "--rate-limit-tokens-per-second", "1")
	time.Sleep(1100 * time.Millisecond) // the readiness polls took no token, but let the bucket be full
	var chans []<-chan balResult
	for range 4 {
		chans = append(chans, balAsync(r.url+"/v1/completions", `{"model":"mock","prompt":"p","max_tokens":1}`))
	}
	codes := map[int]int{}
	for _, ch := range chans {
		codes[(<-ch).code]++
	}
	if codes[200] != 1 || codes[408] != 3 {
		t.Errorf("status counts %v, want one 200 and three 408", codes)
	}
}

func TestBalancerAdmissionQueueTimeout(t *testing.T) {
	t.Parallel()
	w := startWorker(t, "regular", "--prefill-delay", "2500ms", "--tokens", "1")
	r := startRouter(t, "--worker-urls", w.URL(), "--max-concurrent-requests", "1", "--queue-size", "1",
		"--queue-timeout-secs", "1", "--rate-limit-tokens-per-second", "0.001")
	const body = `{"text":"hi"}`
	long := balAsync(r.url+"/generate", body)
	w.waitStats(t, 5*time.Second, "long request in flight", func(s mockworker.Stats) bool { return s.InFlight == 1 })
	res := <-balAsync(r.url+"/generate", body)
	balCheckRejection(t, res, 408, "queue_timeout")
	if res.elapsed < 900*time.Millisecond || res.elapsed > 2*time.Second {
		t.Errorf("408 after %v, want about the 1 s queue timeout", res.elapsed)
	}
	if n := w.stats(t).Requests; n != 1 {
		t.Errorf("worker saw %d requests: the timed-out one must not be sent", n)
	}
	if lr := <-long; lr.code != 200 {
		t.Errorf("long request: %d %s", lr.code, lr.body)
	}
	// The finished request gave its token back.
	if code, out := balStatus(t, r.url+"/generate"); code != 200 {
		t.Errorf("after the long request: %d %s", code, out)
	}
}

func TestBalancerAdmissionClientGoneLeavesQueue(t *testing.T) {
	t.Parallel()
	w := startWorker(t, "regular", "--prefill-delay", "1500ms", "--tokens", "1")
	r := startRouter(t, "--worker-urls", w.URL(), "--max-concurrent-requests", "1", "--queue-size", "1",
		"--queue-timeout-secs", "30", "--rate-limit-tokens-per-second", "0.001")
	const body = `{"text":"hi"}`
	first := balAsync(r.url+"/generate", body)
	w.waitStats(t, 5*time.Second, "first request in flight", func(s mockworker.Stats) bool { return s.InFlight == 1 })
	// A queued client gives up; its place in the queue must be freed.
	impatient := &http.Client{Timeout: 300 * time.Millisecond}
	if resp, err := impatient.Post(r.url+"/generate", "application/json", strings.NewReader(body)); err == nil {
		resp.Body.Close()
		t.Fatalf("queued request answered %d before the first finished", resp.StatusCode)
	}
	var next balResult
	deadline := time.Now().Add(5 * time.Second)
	for { // until the router has noticed the departure, the queue may still look full
		next = <-balAsync(r.url+"/generate", body)
		if next.code != 429 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the queue slot of a departed client was never freed")
		}
		time.Sleep(20 * time.Millisecond)
	}
	if next.code != 200 {
		t.Errorf("request queued after the departure: %d %s", next.code, next.body)
	}
	if res := <-first; res.code != 200 {
		t.Errorf("first: %d %s", res.code, res.body)
	}
	// The departed request never reached the worker: only the first and the last did.
	if s := w.stats(t); s.Requests != 2 || s.ClientGone != 0 {
		t.Errorf("worker stats %+v, want 2 requests and none abandoned", s)
	}
}

// A request whose --request-timeout-secs runs out while it waits in the
// queue must get an error, not an empty 200. Requests share the timeout, so
// a waiter's deadline comes just after that of the token holder ahead of it:
// of two waiters sent together, the first to get the token times out
// upstream (call_upstream_timeout) and the other usually expires in the
// queue before that token comes back (request_timeout). Both are 504s.
func TestBalancerAdmissionRequestTimeoutWhileQueued(t *testing.T) {
	t.Parallel()
	w := startWorker(t, "regular", "--prefill-delay", "5s", "--tokens", "1")
	r := startRouter(t, "--worker-urls", w.URL(), "--max-concurrent-requests", "1", "--queue-size", "2",
		"--queue-timeout-secs", "30", "--request-timeout-secs", "1", "--rate-limit-tokens-per-second", "0.001")
	const body = `{"text":"hi"}`
	long := balAsync(r.url+"/generate", body)
	w.waitStats(t, 5*time.Second, "long request in flight", func(s mockworker.Stats) bool { return s.InFlight == 1 })
	queued := []<-chan balResult{balAsync(r.url+"/generate", body), balAsync(r.url+"/generate", body)}
	for i, ch := range append(queued, long) {
		res := <-ch
		if res.err != nil || res.code != 504 {
			t.Fatalf("request %d past the request timeout: %d (%v) %q, want 504", i, res.code, res.err, res.body)
		}
		if c := decodeError(t, res.body).Error.Code; c != "request_timeout" && c != "call_upstream_timeout" {
			t.Errorf("request %d: 504 with code %q: %s", i, c, res.body)
		}
		if res.elapsed > 2500*time.Millisecond {
			t.Errorf("request %d answered after %v, want about the 1 s request timeout", i, res.elapsed)
		}
	}
}

// --- 6. Admin API -------------------------------------------------------------------

func TestBalancerRemoveWorkerLetsStreamFinish(t *testing.T) {
	t.Parallel()
	a := startWorker(t, "regular", "--worker-id", "a", "--tokens", "10", "--token-delay", "100ms")
	b := startWorker(t, "regular", "--worker-id", "b", "--tokens", "10", "--token-delay", "100ms")
	byID := map[string]worker{"a": a, "b": b}
	r := startRouter(t, "--worker-urls", a.URL(), b.URL(), "--policy", "round_robin")
	balWaitHealth(t, r, a.URL(), true, 10*time.Second)
	balWaitHealth(t, r, b.URL(), true, 10*time.Second)

	resp, err := client.Post(r.url+"/generate", "application/json", strings.NewReader(`{"text":"long one","stream":true}`))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	victimID := resp.Header.Get("X-Worker-Id")
	victim, ok := byID[victimID]
	if resp.StatusCode != 200 || !ok {
		t.Fatalf("stream: %d from %q", resp.StatusCode, victimID)
	}
	br := bufio.NewReader(resp.Body)
	if line, err := br.ReadString('\n'); err != nil || !strings.HasPrefix(line, "data: ") {
		t.Fatalf("first stream line %q: %v", line, err)
	}

	if dr, out := send(t, "DELETE", r.url+"/workers/"+url.PathEscape(victim.URL()), ""); dr.StatusCode != 202 {
		t.Fatalf("DELETE: %d %s", dr.StatusCode, out)
	}
	if ws := balList(t, r); len(ws) != 1 || ws[0].URL == victim.URL() {
		t.Errorf("after DELETE: %+v", ws)
	}
	for i := range 4 {
		if id := balPick(t, r.url+"/generate", `{"text":"hi","sampling_params":{"max_new_tokens":1}}`); id == victimID {
			t.Fatalf("request %d went to removed worker %s", i, id)
		}
	}

	rest, err := io.ReadAll(br)
	if err != nil {
		t.Fatalf("stream cut after removal: %v", err)
	}
	evs := sseEvents(rest)
	if len(evs) < 9 || evs[len(evs)-1] != "[DONE]" {
		t.Errorf("stream did not finish: %s", rest)
	}
	victim.waitStats(t, 5*time.Second, "stream completed", func(s mockworker.Stats) bool {
		return s.Completed == 1 && s.InFlight == 0 && s.ClientGone == 0
	})
}

func TestBalancerUpdateWorker(t *testing.T) {
	t.Parallel()
	w := startWorker(t, "regular", "--worker-id", "w", "--prefill-delay", "600ms", "--tokens", "1")
	r := startRouter(t, "--worker-urls", w.URL())
	balWaitHealth(t, r, w.URL(), true, 10*time.Second)
	ws := balList(t, r)
	if len(ws) != 1 || ws[0].Priority != balancer.DefaultPriority || len(ws[0].Metadata) != 0 {
		t.Fatalf("GET /workers: %+v", ws)
	}
	id := ws[0].ID

	slow := balAsync(r.url+"/generate", `{"text":"hi"}`)
	w.waitStats(t, 5*time.Second, "request in flight", func(s mockworker.Stats) bool { return s.InFlight == 1 })
	resp, out := send(t, "PUT", r.url+"/workers/"+id, `{"priority":7,"cost":2.5,"labels":{"zone":"eu"}}`)
	var put struct {
		Status string        `json:"status"`
		Worker balWorkerInfo `json:"worker"`
	}
	if resp.StatusCode != 202 || json.Unmarshal(out, &put) != nil || put.Worker.Priority != 7 {
		t.Fatalf("PUT: %d %s", resp.StatusCode, out)
	}
	code, wi := balGet(t, r, id)
	if code != 200 || wi.ID != id || wi.Priority != 7 || wi.Cost != 2.5 || wi.Metadata["zone"] != "eu" || !wi.IsHealthy {
		t.Errorf("GET after PUT: %d %+v", code, wi)
	}
	if wi.Load != 1 {
		t.Errorf("load %d after PUT, want the in-flight request counted (1)", wi.Load)
	}
	if ws := balList(t, r); len(ws) != 1 || ws[0].Priority != 7 || ws[0].Metadata["zone"] != "eu" {
		t.Errorf("GET /workers after PUT: %+v", ws)
	}
	if res := <-slow; res.code != 200 {
		t.Errorf("in-flight request across the update: %d %s", res.code, res.body)
	}
	// The request that started before the update released the same counter.
	if _, wi := balGet(t, r, id); wi.Load != 0 {
		t.Errorf("load %d after the request finished, want 0", wi.Load)
	}
	if id := balPick(t, r.url+"/generate", `{"text":"hi"}`); id != "w" {
		t.Errorf("after PUT answered by %s", id)
	}
	// A second PUT changes only what it names.
	if resp, out := send(t, "PUT", r.url+"/workers/"+id, `{"priority":9}`); resp.StatusCode != 202 {
		t.Fatalf("second PUT: %d %s", resp.StatusCode, out)
	}
	if _, wi := balGet(t, r, id); wi.Priority != 9 || wi.Cost != 2.5 || wi.Metadata["zone"] != "eu" {
		t.Errorf("after partial PUT: %+v", wi)
	}
	if resp, _ := send(t, "PUT", r.url+"/workers/00000000-0000-0000-0000-000000000000", `{"priority":1}`); resp.StatusCode != 404 {
		t.Errorf("PUT unknown worker: %d", resp.StatusCode)
	}
}
