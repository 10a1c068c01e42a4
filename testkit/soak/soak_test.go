// Package soak drives mixed streaming and non-streaming PD load through the
// real binaries (pdrouter in front of 2 prefill + 2 decode mockworkers whose
// KV moves through their kvproxies) and asserts that the router's and the
// kvproxies' RSS, goroutines and open fds stay flat (issue 13, Deliver 9).
//
// `go test` runs a 20 s pass (RSS logged, not judged: see rssMinRun);
// `make soak MINUTES=N` sets SOAK_MINUTES.
//
// Every checkpoint pauses the load, waits until nothing is in flight and
// samples each process idle, so in-flight work is not mistaken for growth.
// The first checkpoint after the warm-up is the baseline; the last must
// stay within the bounds below. Each process's start (idle, before any
// load), baseline, end and peak are logged, one line each.
package soak

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pdrouter/pdrouter/testkit/testenv"
)

func TestMain(m *testing.M) { testenv.Main(m) }

const (
	// concurrency is the requests the load keeps in flight; it also caps
	// its connections to the router.
	concurrency = 16
	// countSlack bounds goroutine and fd growth, baseline to end, at idle.
	// Idle goroutines and fds are the listeners plus one per pooled
	// connection: up to concurrency towards the router and a few per
	// worker from it. A leak of one per thousand requests exceeds it
	// within a 10-minute run (tens of thousands of requests).
	countSlack = 2 * concurrency
	// rssSlackMiB and rssSlackRatio bound RSS growth, baseline to end:
	// the larger of the two. GC pacing and pools that fill slowly move
	// RSS a few MiB; a 1 KiB-per-request leak is tens of MiB in 10 min.
	rssSlackMiB   = 16
	rssSlackRatio = 0.25
	// rssMinRun is the shortest run whose RSS is judged: the router's heap
	// and prefix tree take about a minute of load to settle (the 10-minute
	// run's baseline at 61 s stayed within 3 MiB), so a shorter pass, as
	// `go test`'s, checks goroutines, fds and failures and only logs RSS.
	rssMinRun = 2 * time.Minute
)

// KV pool of 2 layers × (K, V) × 64 bytes per token: the data path of a
// real layout at a size 2 shared cores soak for minutes.
var kvFlags = []string{"--kv-layers", "2", "--kv-bytes-per-token", "64", "--kv-pool-tokens", "65536", "--kv-chunk-tokens", "1024"}

func duration(t *testing.T) time.Duration {
	v := os.Getenv("SOAK_MINUTES")
	if v == "" {
		return 20 * time.Second
	}
	m, err := strconv.ParseFloat(v, 64)
	if err != nil || m <= 0 {
		t.Fatalf("SOAK_MINUTES=%q: want a positive number", v)
	}
	return time.Duration(m * float64(time.Minute))
}

// proc is a process whose resources the soak watches.
type proc struct {
	name    string
	pid     int
	metrics string // its /metrics, for go_goroutines
}

type sample struct {
	AtS        float64 `json:"at_s"` // since the load began
	RSSMiB     float64 `json:"rss_mib"`
	Goroutines int     `json:"goroutines"`
	FDs        int     `json:"fds"`
}

func (s sample) String() string {
	return fmt.Sprintf("rss %.1f MiB, %d goroutines, %d fds", s.RSSMiB, s.Goroutines, s.FDs)
}

var (
	vmRSS      = regexp.MustCompile(`VmRSS:\s+(\d+) kB`)
	goroutines = regexp.MustCompile(`(?m)^go_goroutines (\d+)`)
)

func (p proc) sample(t *testing.T, at time.Duration) sample {
	t.Helper()
	st, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", p.pid))
	if err != nil {
		t.Fatalf("%s: %v (exited?)", p.name, err)
	}
	kb, _ := strconv.Atoi(string(vmRSS.FindSubmatch(st)[1]))
	fds, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", p.pid))
	if err != nil {
		t.Fatalf("%s: %v", p.name, err)
	}
	body := get(t, p.metrics)
	m := goroutines.FindSubmatch(body)
	if m == nil {
		t.Fatalf("%s: no go_goroutines at %s", p.name, p.metrics)
	}
	g, _ := strconv.Atoi(string(m[1]))
	return sample{AtS: at.Seconds(), RSSMiB: float64(kb) / 1024, Goroutines: g, FDs: len(fds)}
}

var metricsClient = &http.Client{Timeout: 10 * time.Second}

func get(t *testing.T, url string) []byte {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	_, b := testenv.Do(t, metricsClient, req)
	return b
}

func start(t *testing.T, name, ready string, args ...string) *testenv.Proc {
	t.Helper()
	bin := testenv.BuildBinary(t, name, testenv.Build{CGO: name == "kvproxy", NoRace: true})
	return testenv.StartWith(t, bin, testenv.Options{Ready: ready, ReadyTimeout: 30 * time.Second}, args...)
}

type deployment struct {
	router  string
	watched []proc
	proxies []string // kvproxy metrics URLs
}

// deploy starts 2 prefill and 2 decode mockworkers with kvproxies (tcp
// transport) and pdrouter in PD mode with its default policy, cache_aware.
// Its prefix tree grows by design up to --max-tree-size (64 MiB by
// default, evicted every 60 s): a 4 MiB bound evicted every 5 s reaches
// that steady state within the warm-up, so what grows after it is a leak.
func deploy(t *testing.T) *deployment {
	dir := t.TempDir()
	d := &deployment{}
	routerArgs := []string{"--pd-disaggregation", "--host", "127.0.0.1", "--max-tree-size", strconv.Itoa(4 << 20), "--eviction-interval-secs", "5"}
	for i, role := range []string{"prefill", "prefill", "decode", "decode"} {
		sock := filepath.Join(dir, fmt.Sprintf("kv%d.sock", i))
		mport := testenv.FreePort(t)
		args := []string{"--role", role, "--transport", "tcp", "--control", sock, "--metrics-port", strconv.Itoa(mport), "--log-level", "warn"}
		boot := 0
		if role == "prefill" {
			boot = testenv.FreePort(t)
			args = append(args, "--bootstrap-port", strconv.Itoa(boot))
		}
		kp := start(t, "kvproxy", "kvproxy ready", args...)
		metrics := fmt.Sprintf("http://127.0.0.1:%d/metrics", mport)
		d.watched = append(d.watched, proc{fmt.Sprintf("kvproxy-%s%d", role[:1], i%2), kp.Cmd.Process.Pid, metrics})
		d.proxies = append(d.proxies, metrics)
		port := testenv.FreePort(t)
		start(t, "mockworker", "listening on", append([]string{"--role", role, "--port", strconv.Itoa(port), "--kvproxy", sock,
			"--tokens", "16", "--token-delay", "2ms"}, kvFlags...)...)
		url := fmt.Sprintf("http://127.0.0.1:%d", port)
		if role == "prefill" {
			routerArgs = append(routerArgs, "--prefill", url, strconv.Itoa(boot))
		} else {
			routerArgs = append(routerArgs, "--decode", url)
		}
	}
	port, prom := testenv.FreePort(t), testenv.FreePort(t)
	routerArgs = append(routerArgs, "--port", strconv.Itoa(port), "--prometheus-host", "127.0.0.1", "--prometheus-port", strconv.Itoa(prom))
	r := start(t, "pdrouter", "pdrouter listening", routerArgs...)
	d.router = fmt.Sprintf("http://127.0.0.1:%d", port)
	d.watched = append([]proc{{"pdrouter", r.Cmd.Process.Pid, fmt.Sprintf("http://127.0.0.1:%d/metrics", prom)}}, d.watched...)
	return d
}

// request is one of four kinds in turn: chat streamed and whole,
// /generate whole, completions streamed; prompts of 16 to 1,024 words.
func request(i int, rng *rand.Rand) (path string, body []byte, stream bool) {
	var words strings.Builder
	for range 16 + rng.IntN(1009) {
		fmt.Fprintf(&words, "w%d ", rng.IntN(5000))
	}
	prompt := words.String()
	var v any
	switch i % 4 {
	case 0, 1:
		path, stream = "/v1/chat/completions", i%4 == 0
		v = map[string]any{"model": "mock", "stream": stream, "max_tokens": 16,
			"messages": []map[string]string{{"role": "user", "content": prompt}}}
	case 2:
		path = "/generate"
		v = map[string]any{"text": prompt, "sampling_params": map[string]any{"max_new_tokens": 16}}
	default:
		path, stream = "/v1/completions", true
		v = map[string]any{"model": "mock", "stream": true, "max_tokens": 16, "prompt": prompt}
	}
	body, _ = json.Marshal(v)
	return path, body, stream
}

var checksumOK = []byte(`"checksum_ok":true`)

// send makes one request and checks it came back whole, with its KV moved
// and verified by the decode engine.
func send(ctx context.Context, c *http.Client, base string, i int, rng *rand.Rand) error {
	path, body, stream := request(i, rng)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+path, bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := c.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	out, err := io.ReadAll(resp.Body)
	switch {
	case err != nil:
		return fmt.Errorf("%s: reading: %w", path, err)
	case resp.StatusCode != 200:
		return fmt.Errorf("%s: %d %.300s", path, resp.StatusCode, out)
	case stream && !bytes.HasSuffix(bytes.TrimSpace(out), []byte("data: [DONE]")):
		return fmt.Errorf("%s: stream did not end with [DONE]: %.300s", path, out)
	case !bytes.Contains(out, checksumOK):
		return fmt.Errorf("%s: no verified kv_transfer in %.300s", path, out)
	}
	return nil
}

// load keeps concurrency requests in flight until ctx ends; pause() stops
// it and returns once nothing is in flight, resume() restarts it.
type load struct {
	mu       sync.Mutex
	gate     *sync.RWMutex // workers hold it read-locked per request
	ok, fail atomic.Int64
	errs     []error
}

func runLoad(ctx context.Context, base string, wg *sync.WaitGroup) *load {
	l := &load{gate: &sync.RWMutex{}}
	tr := &http.Transport{MaxConnsPerHost: concurrency, MaxIdleConnsPerHost: concurrency, IdleConnTimeout: time.Hour}
	c := &http.Client{Transport: tr, Timeout: time.Minute}
	for w := range concurrency {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), 7))
			for i := w; ctx.Err() == nil; i += concurrency {
				l.gate.RLock()
				err := send(ctx, c, base, i, rng)
				l.gate.RUnlock()
				if err == nil {
					l.ok.Add(1)
				} else if ctx.Err() == nil {
					l.fail.Add(1)
					l.mu.Lock()
					if len(l.errs) < 5 {
						l.errs = append(l.errs, err)
					}
					l.mu.Unlock()
				}
			}
		})
	}
	context.AfterFunc(ctx, tr.CloseIdleConnections)
	return l
}

func (l *load) pause()  { l.gate.Lock() }
func (l *load) resume() { l.gate.Unlock() }

func TestSoak(t *testing.T) {
	if testing.Short() {
		t.Skip("soak: skipped with -short")
	}
	total := duration(t)
	warmup := max(5*time.Second, total/10)
	every := min(max(total/20, 5*time.Second), 30*time.Second)
	d := deploy(t)
	testenv.WaitStatus(t, d.router+"/readiness", 200, 30*time.Second)
	starts := map[string]sample{}
	for _, p := range d.watched {
		starts[p.name] = p.sample(t, 0)
	}

	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	l := runLoad(ctx, d.router, &wg)
	defer func() { cancel(); wg.Wait() }()

	began := time.Now()
	samples := map[string][]sample{}
	checkpoint := func() {
		l.pause()
		defer l.resume()
		// Idle: let finished requests' goroutines and rooms wind down.
		for _, u := range d.proxies {
			deadline := time.Now().Add(5 * time.Second)
			for rooms(t, u) != 0 && time.Now().Before(deadline) {
				time.Sleep(20 * time.Millisecond)
			}
		}
		time.Sleep(500 * time.Millisecond)
		at := time.Since(began).Round(time.Second)
		for _, p := range d.watched {
			samples[p.name] = append(samples[p.name], p.sample(t, at))
		}
	}
	time.Sleep(warmup)
	checkpoint()
	for next := warmup + every; next <= total; next += every {
		time.Sleep(time.Until(began.Add(next)))
		checkpoint()
	}
	if len(samples["pdrouter"]) < 2 {
		checkpoint()
	}
	cancel()
	wg.Wait()

	ok, failed := l.ok.Load(), l.fail.Load()
	t.Logf("%v: %d requests, %d failed, %.0f/s; warm-up %v, a checkpoint every %v", total, ok+failed, failed,
		float64(ok+failed)/time.Since(began).Seconds(), warmup, every)
	if failed != 0 {
		t.Errorf("%d of %d requests failed, first: %v", failed, ok+failed, l.errs)
	}
	if ok == 0 {
		t.Fatal("no request succeeded")
	}
	for _, u := range d.proxies {
		if n := rooms(t, u); n != 0 {
			t.Errorf("%s: %v rooms still active", u, n)
		}
	}
	report(t, d.watched, starts, samples, total >= rssMinRun)
}

// rooms is a kvproxy's kvproxy_rooms_active summed over its roles.
func rooms(t *testing.T, url string) float64 {
	sum := 0.0
	sc := bufio.NewScanner(bytes.NewReader(get(t, url)))
	for sc.Scan() {
		if f := strings.Fields(sc.Text()); len(f) == 2 && strings.HasPrefix(f[0], "kvproxy_rooms_active") {
			v, _ := strconv.ParseFloat(f[1], 64)
			sum += v
		}
	}
	return sum
}

// report logs every process's samples (and writes them, with the starts,
// to $SOAK_OUT as JSON) and fails on growth beyond the bounds, baseline to
// end (RSS's only if judgeRSS): the start is before pools and caches fill.
func report(t *testing.T, watched []proc, starts map[string]sample, samples map[string][]sample, judgeRSS bool) {
	if out := os.Getenv("SOAK_OUT"); out != "" {
		b, _ := json.MarshalIndent(map[string]any{"start": starts, "checkpoints": samples}, "", " ")
		if err := os.WriteFile(out, b, 0o644); err != nil {
			t.Error(err)
		}
	}
	for _, p := range watched {
		s := samples[p.name]
		base, end := s[0], s[len(s)-1]
		var peak sample
		for _, x := range s {
			peak.RSSMiB, peak.Goroutines, peak.FDs = max(peak.RSSMiB, x.RSSMiB), max(peak.Goroutines, x.Goroutines), max(peak.FDs, x.FDs)
		}
		t.Logf("%-11s start %v | baseline %v | end %v | peak %v", p.name, starts[p.name], base, end, peak)
		rssBound := base.RSSMiB + max(rssSlackMiB, rssSlackRatio*base.RSSMiB)
		if judgeRSS && end.RSSMiB > rssBound {
			t.Errorf("%s: RSS %.1f -> %.1f MiB, over the %.1f MiB bound", p.name, base.RSSMiB, end.RSSMiB, rssBound)
		}
		if end.Goroutines > base.Goroutines+countSlack {
			t.Errorf("%s: goroutines %d -> %d, over +%d", p.name, base.Goroutines, end.Goroutines, countSlack)
		}
		if end.FDs > base.FDs+countSlack {
			t.Errorf("%s: fds %d -> %d, over +%d", p.name, base.FDs, end.FDs, countSlack)
		}
	}
}
