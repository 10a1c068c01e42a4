package chaos

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pdrouter/pdrouter/internal/testenv"
)

// Row 14 (issue 26 item 4): a reconnecting flood of silent connections
// from another address holds the bootstrap port at its 1,024-connection
// cap. Engines and kvproxies that asked /route before are still answered
// every time, PD requests keep moving their KV, and a caller new to the
// port is refused at once.
func TestKVProxyBootstrapFloodAtCap(t *testing.T) {
	dir := t.TempDir()
	kv := testenv.BuildBinary(t, "kvproxy", testenv.Build{CGO: true})
	mock := testenv.Binary(t, "mockworker")
	workerFlags := []string{"--port", "0", "--tokens", "4", "--kv-layers", "2", "--kv-bytes-per-token", "64",
		"--kv-pool-tokens", "4096", "--kv-chunk-tokens", "256"}
	boot := testenv.FreePort(t)
	prefillKV := testenv.StartWith(t, kv, kvReady, kvproxyArgs("prefill", filepath.Join(dir, "p.sock"), boot)...)
	testenv.StartWith(t, kv, kvReady, kvproxyArgs("decode", filepath.Join(dir, "d.sock"), -1)...)
	prefill := testenv.StartWith(t, mock, testenv.Options{Ready: "listening on "},
		append([]string{"--role", "prefill", "--kvproxy", filepath.Join(dir, "p.sock")}, workerFlags...)...)
	decode := testenv.StartWith(t, mock, testenv.Options{Ready: "listening on "},
		append([]string{"--role", "decode", "--kvproxy", filepath.Join(dir, "d.sock")}, workerFlags...)...)
	port := testenv.FreePort(t)
	router := "http://127.0.0.1:" + strconv.Itoa(port)
	testenv.Start(t, testenv.Binary(t, "pdrouter"), "--host", "127.0.0.1", "--port", strconv.Itoa(port),
		"--prometheus-port", "0", "--log-level", "warn", "--pd-disaggregation",
		"--prefill", prefill.URL(), strconv.Itoa(boot), "--decode", decode.URL())
	testenv.WaitStatus(t, router+"/readiness", 200, 30*time.Second)
	bootAddr := "127.0.0.1:" + strconv.Itoa(boot)
	route := "http://" + bootAddr + "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
	testenv.WaitStatus(t, route, 200, 30*time.Second) // 127.0.0.1 is a known peer from now on

	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	var mu sync.Mutex
	held := 0
	from := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP("127.0.0.2")}}
	for range 1100 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil {
				c, err := from.DialContext(ctx, "tcp", bootAddr)
				if err != nil {
					time.Sleep(10 * time.Millisecond)
					continue
				}
				stop := context.AfterFunc(ctx, func() { c.Close() })
				mu.Lock()
				held++
				mu.Unlock()
				_, _ = io.Copy(io.Discard, c) // until kvproxy closes it
				mu.Lock()
				held--
				mu.Unlock()
				stop()
				c.Close()
			}
		}()
	}
	defer func() {
		cancel()
		wg.Wait()
	}()
	time.Sleep(2 * time.Second) // the flood fills the strangers' share and keeps redialling
	mu.Lock()
	flooding := held
	mu.Unlock()

	known := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	defer known.CloseIdleConnections()
	for i := range 40 {
		resp, err := known.Get(route)
		if err != nil {
			t.Fatalf("GET /route %d from a known peer under the flood: %v", i, err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("GET /route %d from a known peer under the flood: %d", i, resp.StatusCode)
		}
	}
	for i := range size(10, 50) {
		body := fmt.Sprintf(`{"text":"flood %d","sampling_params":{"max_new_tokens":4}}`, i)
		resp, err := client.Post(router+"/generate", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatalf("room %d during the flood: %v", i, err)
		}
		out, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || !bytes.Contains(out, []byte(`"checksum_ok":true`)) {
			t.Fatalf("room %d during the flood: %d %.300s", i, resp.StatusCode, out)
		}
	}
	// A caller new to the port is refused at once: a 503 when a refusal
	// slot is free, else a closed connection (the flood's own refusals wait
	// for request heads that never come), never a hang.
	d := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP("127.0.0.3")}}
	stranger := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{DialContext: d.DialContext, DisableKeepAlives: true}}
	outcome := "503"
	resp, err := stranger.Get(route)
	switch {
	case err != nil && isTimeout(err):
		t.Errorf("GET /route from a new caller under the flood hung: %v", err)
	case err != nil:
		outcome = "closed: " + err.Error()
	default:
		resp.Body.Close()
		if resp.StatusCode != http.StatusServiceUnavailable {
			t.Errorf("GET /route from a new caller under the flood: %d, want 503", resp.StatusCode)
		}
	}
	alive(t, prefillKV, "under the flood")
	t.Logf("%d flood connections held open: 40 /route calls from a known peer answered 200, a new caller: %s", flooding, outcome)
}
