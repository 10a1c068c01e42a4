// Package e2e runs real processes: pdrouter, mockworkers in PD roles and
// their kvproxies, and checks that KV bytes really cross and that every fault
// ends every room.
//
// Layout in these tests: 2 layers × (K, V) × 64 bytes per token (page 16),
// so a 32k-token prompt moves 8 MiB instead of Llama-3.1-8B's 4 GiB; the
// data path is the same, memory stays sane on a 2-core CI box.
package e2e

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net/http"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pdrouter/pdrouter/testkit/testenv"
)

var kvFlags = []string{"--kv-layers", "2", "--kv-bytes-per-token", "64", "--kv-pool-tokens", "262144", "--kv-chunk-tokens", "4096"}

const bytesPerPage = 2 * 2 * 64 * 16 // buffers × bytes per token × page size

func TestMain(m *testing.M) { testenv.Main(m) }

// bin builds the named command the way these tests run it: without -race
// (the data path is what they time; pdrouter and mockworker as they ship,
// cgo off), kvproxy with cgo for its ucx transport.
func bin(t *testing.T, name string) string {
	t.Helper()
	if testing.Short() {
		t.Skip("end-to-end: skipped with -short")
	}
	return testenv.BuildBinary(t, name, testenv.Build{CGO: name == "kvproxy", NoRace: true})
}

// start runs a binary until the test ends and waits for its ready line.
func start(t *testing.T, env []string, ready string, name string, args ...string) *testenv.Proc {
	t.Helper()
	return testenv.StartWith(t, bin(t, name), testenv.Options{Env: env, Ready: ready, ReadyTimeout: 20 * time.Second}, args...)
}

type worker struct {
	url       string
	boot      int    // prefill: bootstrap port
	metrics   string // its kvproxy's metrics URL
	proxy     *testenv.Proc
	proxyArgs []string // to start it again
	engine    *testenv.Proc
}

type cluster struct {
	router   string
	prefills []worker
	decodes  []worker
}

type opts struct {
	transport, tls    string
	prefills, decodes int
	timeouts          string // bootstrap and waiting timeout
	prefillDelay      string
	heartbeat         string // default 500ms
	router            bool
	routerArgs        []string
}

func startCluster(t *testing.T, o opts) *cluster {
	dir := t.TempDir()
	env := []string{}
	if o.tls != "" {
		env = append(env, "UCX_TLS="+o.tls, "UCX_NET_DEVICES=lo")
	}
	if o.heartbeat == "" {
		o.heartbeat = "500ms"
	}
	c := &cluster{}
	add := func(role string, i int) worker {
		sock := filepath.Join(dir, fmt.Sprintf("%s%d.sock", role, i))
		mport := testenv.FreePort(t)
		args := []string{"--role", role, "--transport", o.transport, "--control", sock, "--metrics-port", strconv.Itoa(mport),
			"--bootstrap-timeout", o.timeouts, "--waiting-timeout", o.timeouts, "--heartbeat-interval", o.heartbeat, "--log-level", "warn"}
		w := worker{metrics: fmt.Sprintf("http://127.0.0.1:%d/metrics", mport)}
		if role == "prefill" {
			w.boot = testenv.FreePort(t)
			args = append(args, "--bootstrap-port", strconv.Itoa(w.boot))
		}
		w.proxy, w.proxyArgs = start(t, env, "kvproxy ready", "kvproxy", args...), args
		port := testenv.FreePort(t)
		margs := append([]string{"--role", role, "--port", strconv.Itoa(port), "--kvproxy", sock, "--tokens", "4"}, kvFlags...)
		if role == "prefill" && o.prefillDelay != "" {
			margs = append(margs, "--prefill-delay", o.prefillDelay)
		}
		w.engine = start(t, nil, "listening on", "mockworker", margs...)
		w.url = fmt.Sprintf("http://127.0.0.1:%d", port)
		return w
	}
	for i := 0; i < o.prefills; i++ {
		c.prefills = append(c.prefills, add("prefill", i))
	}
	for i := 0; i < o.decodes; i++ {
		c.decodes = append(c.decodes, add("decode", i))
	}
	if o.router {
		port := testenv.FreePort(t)
		args := []string{"--pd-disaggregation", "--host", "127.0.0.1", "--port", strconv.Itoa(port), "--prometheus-port", strconv.Itoa(testenv.FreePort(t))}
		for _, p := range c.prefills {
			args = append(args, "--prefill", p.url, strconv.Itoa(p.boot))
		}
		for _, d := range c.decodes {
			args = append(args, "--decode", d.url)
		}
		args = append(args, o.routerArgs...)
		start(t, nil, "listening", "pdrouter", args...)
		c.router = fmt.Sprintf("http://127.0.0.1:%d", port)
	}
	return c
}

type kvInfo struct {
	Bytes      int64   `json:"bytes"`
	Pages      int64   `json:"pages"`
	Transport  string  `json:"transport"`
	ChecksumOK bool    `json:"checksum_ok"`
	TransferMS float64 `json:"transfer_ms"`
}

func body(tokens int, extra string) []byte {
	var b strings.Builder
	b.WriteString(`{"input_ids":[`)
	for i := 0; i < tokens; i++ {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(strconv.Itoa(rand.IntN(32000)))
	}
	b.WriteString(`],"sampling_params":{"max_new_tokens":4}` + extra + `}`)
	return []byte(b.String())
}

func post(ctx context.Context, url string, b []byte) (int, []byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url+"/generate", bytes.NewReader(b))
	if err != nil {
		return 0, nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	out, err := io.ReadAll(resp.Body)
	return resp.StatusCode, out, err
}

// roomsActive sums kvproxy_rooms_active over a kvproxy's roles.
func metric(t *testing.T, url, name string) float64 {
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	sum := 0.0
	re := regexp.MustCompile(`^` + name + `(\{[^}]*\})? (\S+)$`)
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if m := re.FindStringSubmatch(sc.Text()); m != nil {
			v, _ := strconv.ParseFloat(m[2], 64)
			sum += v
		}
	}
	return sum
}

func (c *cluster) noRoomsLeft(t *testing.T, within time.Duration) {
	t.Helper()
	for _, w := range append(append([]worker{}, c.prefills...), c.decodes...) {
		deadline := time.Now().Add(within)
		for metric(t, w.metrics, "kvproxy_rooms_active") != 0 {
			if time.Now().After(deadline) {
				t.Fatalf("%s: rooms still active", w.metrics)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
}

// waitRouter waits until the router sends a request through.
func waitRouter(t *testing.T, c *cluster) {
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		code, _, err := post(context.Background(), c.router, body(16, ""))
		if err == nil && code == 200 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("router not serving: %d %v", code, err)
		}
	}
}

func TestKVThroughRouter(t *testing.T) {
	for _, tc := range []struct{ name, transport, tls string }{
		{"tcp", "tcp", ""}, {"shm", "shm", ""}, {"ucx-tcp", "ucx", "tcp"}, {"ucx-shm", "ucx", "posix,cma,tcp"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := startCluster(t, opts{transport: tc.transport, tls: tc.tls, prefills: 2, decodes: 2, timeouts: "30s", router: true})
			waitRouter(t, c)
			const n, par = 500, 8
			errs := make(chan error, n)
			sem := make(chan struct{}, par)
			var wg sync.WaitGroup
			for i := 0; i < n; i++ {
				// Log-uniform 16 … 32768 tokens, both ends included.
				tokens := int(16 * math.Pow(2048, float64(i)/float64(n-1)))
				sem <- struct{}{}
				wg.Go(func() {
					defer func() { <-sem }()
					errs <- checkOne(c.router, tokens, tc.transport)
				})
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				if err != nil {
					t.Error(err)
				}
			}
			c.noRoomsLeft(t, 2*time.Second)
		})
	}
}

func checkOne(url string, tokens int, transport string) error {
	code, out, err := post(context.Background(), url, body(tokens, ""))
	if err != nil || code != 200 {
		return fmt.Errorf("%d tokens: %d %v %s", tokens, code, err, out)
	}
	var r struct {
		MetaInfo struct {
			KV *kvInfo `json:"kv_transfer"`
		} `json:"meta_info"`
	}
	if err := json.Unmarshal(out, &r); err != nil || r.MetaInfo.KV == nil {
		return fmt.Errorf("%d tokens: no kv_transfer in %s", tokens, out)
	}
	kv := r.MetaInfo.KV
	pages := int64((tokens + 15) / 16)
	if !kv.ChecksumOK || kv.Pages != pages || kv.Bytes != pages*bytesPerPage+64 || kv.Transport != transport {
		return fmt.Errorf("%d tokens: %+v, want %d pages over %s", tokens, kv, pages, transport)
	}
	return nil
}

func TestFaults(t *testing.T) {
	c := startCluster(t, opts{transport: "tcp", prefills: 1, decodes: 1, timeouts: "3s", prefillDelay: "1s", router: true})
	waitRouter(t, c)
	p, d := c.prefills[0], c.decodes[0]
	boot := fmt.Sprintf(`,"bootstrap_host":"127.0.0.1","bootstrap_port":%d,"bootstrap_room":%%d`, p.boot)

	t.Run("decode-only-waiting-timeout", func(t *testing.T) {
		start := time.Now()
		code, out, err := post(context.Background(), d.url, body(64, fmt.Sprintf(boot, 101)))
		if err != nil || code != 500 || !strings.Contains(string(out), "waiting timeout") {
			t.Fatalf("%d %v %s", code, err, out)
		}
		if el := time.Since(start); el < 3*time.Second || el > 6*time.Second {
			t.Fatalf("failed after %v, want the 3 s waiting timeout", el)
		}
		c.noRoomsLeft(t, 2*time.Second)
	})

	t.Run("prefill-only-bootstrap-timeout", func(t *testing.T) {
		failed := metric(t, p.metrics, `kvproxy_rooms_total\{role="prefill",state="Failed"\}`)
		code, out, err := post(context.Background(), p.url, body(64, fmt.Sprintf(boot, 102)))
		if err != nil || code != 500 || !strings.Contains(string(out), "bootstrap timeout") {
			t.Fatalf("%d %v %s", code, err, out)
		}
		if metric(t, p.metrics, `kvproxy_rooms_total\{role="prefill",state="Failed"\}`) != failed+1 {
			t.Fatal("prefill room not counted as failed")
		}
		c.noRoomsLeft(t, 2*time.Second)
	})

	t.Run("client-disconnect-aborts-both", func(t *testing.T) {
		pf := metric(t, p.metrics, `kvproxy_rooms_total\{role="prefill",state="Failed"\}`)
		df := metric(t, d.metrics, `kvproxy_rooms_total\{role="decode",state="Failed"\}`)
		ctx, cancel := context.WithCancel(context.Background())
		errc := make(chan error, 1)
		go func() { _, _, err := post(ctx, c.router, body(64, "")); errc <- err }()
		// The decode side expects the room at once; the prefill side holds it
		// WaitingForInput while the prefill engine "computes" for 1 s.
		for metric(t, p.metrics, "kvproxy_rooms_active") == 0 {
			time.Sleep(10 * time.Millisecond)
		}
		cancel()
		<-errc
		c.noRoomsLeft(t, time.Second) // well before the 3 s timeouts
		if metric(t, p.metrics, `kvproxy_rooms_total\{role="prefill",state="Failed"\}`) != pf+1 ||
			metric(t, d.metrics, `kvproxy_rooms_total\{role="decode",state="Failed"\}`) != df+1 {
			t.Fatal("rooms not failed on both sides")
		}
	})

	t.Run("prefill-kvproxy-killed", func(t *testing.T) {
		type res struct {
			code int
			out  []byte
			err  error
		}
		rc := make(chan res, 1)
		go func() {
			code, out, err := post(context.Background(), c.router, body(64, ""))
			rc <- res{code, out, err}
		}()
		for metric(t, p.metrics, "kvproxy_rooms_active") == 0 {
			time.Sleep(10 * time.Millisecond)
		}
		killed := time.Now()
		if err := p.proxy.Cmd.Process.Kill(); err != nil {
			t.Fatal(err)
		}
		r := <-rc
		if r.err != nil || r.code < 500 || time.Since(killed) > time.Second {
			t.Fatalf("after kill: %d %v %s in %v", r.code, r.err, r.out, time.Since(killed))
		}
		if metric(t, d.metrics, "kvproxy_rooms_active") != 0 {
			t.Fatal("decode room still active")
		}
	})
}
