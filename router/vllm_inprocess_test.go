package router

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/pdrouter/pdrouter/balancer"
	"github.com/pdrouter/pdrouter/mock/mockworker"
)

// fakeVLLM is an engine whose generation replies a test scripts; it keeps
// the bodies it got.
type fakeVLLM struct {
	*httptest.Server
	mu     sync.Mutex
	bodies []string
}

func startFakeVLLM(t *testing.T, reply func(w http.ResponseWriter)) *fakeVLLM {
	f := &fakeVLLM{}
	mux := http.NewServeMux()
	mux.HandleFunc("/health", func(http.ResponseWriter, *http.Request) {})
	mux.HandleFunc("POST /v1/completions", func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		f.mu.Lock()
		f.bodies = append(f.bodies, string(b))
		f.mu.Unlock()
		reply(w)
	})
	f.Server = httptest.NewServer(mux)
	t.Cleanup(f.Close)
	return f
}

func (f *fakeVLLM) got() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.bodies...)
}

// What a prefill's 2xx reply says decides the decode leg: no
// kv_transfer_params sends null (the decode computes the prompt), a reply
// that is not a JSON object fails the attempt and the prefill's breaker,
// and neither leaves a goroutine behind.
func TestVLLMPrefillReplies(t *testing.T) {
	defer goleak.VerifyNone(t,
		goleak.IgnoreAnyFunction("github.com/valyala/fasthttp.updateServerDate.func1"),
		goleak.IgnoreAnyFunction("github.com/valyala/fasthttp.(*workerPool).Start.func2"))
	for _, c := range []struct {
		name, prefill string
		status        int
		decodeGot     string
	}{
		{"no params", `{"id":"x","choices":[{"text":" a"}]}`, 200, `{"prompt":"a","kv_transfer_params":null}`},
		{"params", `{"choices":[],"kv_transfer_params":{"remote_engine_id":"e","remote_block_ids":[[1,2]]}}`, 200,
			`{"prompt":"a","kv_transfer_params":{"remote_engine_id":"e","remote_block_ids":[[1,2]]}}`},
		{"not JSON", `<html>oops</html>`, 502, ""},
		{"truncated JSON", `{"kv_transfer_params":{"a":`, 502, ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			p := startFakeVLLM(t, func(w http.ResponseWriter) { io.WriteString(w, c.prefill) })
			d := startFakeVLLM(t, func(w http.ResponseWriter) { io.WriteString(w, `{"choices":[{"text":" b"}]}`) })
			cfg := DefaultConfig()
			cfg.PDDisaggregation, cfg.VLLMPDDisaggregation = true, true
			cfg.Prefill = []PrefillSpec{{URL: p.URL, BootstrapPort: balancer.NoBootstrapPort}}
			cfg.Decode = []string{d.URL}
			cfg.Retry.MaxRetries = 1
			cfg.Manager.Breaker.FailureThreshold = 1
			base, srv := serveInProcess(t, cfg)
			tr := &http.Transport{}
			resp, err := (&http.Client{Transport: tr}).Post(base+"/v1/completions", "application/json", strings.NewReader(`{"prompt":"a"}`))
			if err != nil {
				t.Fatal(err)
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			tr.CloseIdleConnections()
			if resp.StatusCode != c.status {
				t.Errorf("status %d %s, want %d", resp.StatusCode, b, c.status)
			}
			if got := d.got(); c.decodeGot == "" && len(got) != 0 || c.decodeGot != "" && (len(got) != 1 || got[0] != c.decodeGot) {
				t.Errorf("decode got %q, want %q", got, c.decodeGot)
			}
			if pw := srv.reg.Snapshot().ByType[balancer.Prefill][0]; pw.Available() != (c.status == 200) {
				t.Errorf("prefill available %v after a %d", pw.Available(), c.status)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			if err := srv.Shutdown(ctx); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// A vLLM stream whose decode goes silent ends at the stream idle timeout
// with one SSE error event, and its decode leg's connection is closed, which
// is how vLLM hears to abort (no /abort_request is sent).
func TestVLLMStreamIdleTimeout(t *testing.T) {
	defer leakCheck(t)
	p := startMock(t, mockworker.Config{Role: mockworker.RoleVLLMPrefill})
	d := startMock(t, mockworker.Config{Role: mockworker.RoleVLLMDecode, Tokens: 3, TokenDelay: 10 * time.Second})
	cfg := DefaultConfig()
	cfg.PDDisaggregation, cfg.VLLMPDDisaggregation = true, true
	cfg.Prefill = []PrefillSpec{{URL: p.URL(), BootstrapPort: balancer.NoBootstrapPort}}
	cfg.Decode = []string{d.URL()}
	cfg.StreamIdleTimeout = 300 * time.Millisecond
	base, srv := serveInProcess(t, cfg)
	defer shutdown(t, srv)
	start := time.Now()
	status, body := postStream(t, base+"/v1/completions", `{"prompt":"a b","stream":true}`)
	events := sseEvents(body)
	if status != 200 || len(events) != 2 || !strings.Contains(events[1], `"code":"stream_idle_timeout"`) {
		t.Fatalf("status %d, events %q: want a token, then one stream_idle_timeout event", status, events)
	}
	if took := time.Since(start); took > 3*time.Second {
		t.Fatalf("stream ended after %v, want about the 300 ms idle timeout", took)
	}
	waitFor(t, func() bool { return d.Stats().ClientGone == 1 })
	if n := len(d.Aborts()) + len(p.Aborts()); n != 0 {
		t.Errorf("%d SGLang aborts sent to vLLM engines", n)
	}
	http.DefaultClient.CloseIdleConnections()
}

// Both legs ride pooled connections: sequential requests post from one
// connection to each engine, whether the prefill's reply has a length or
// comes chunked (its body is read to the end before the next request).
func TestVLLMReusesConnections(t *testing.T) {
	for _, chunked := range []bool{false, true} {
		var mu sync.Mutex
		posters := map[string]map[string]bool{"prefill": {}, "decode": {}}
		engine := func(role, reply string) *httptest.Server {
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				_, _ = io.ReadAll(r.Body)
				if r.Method == http.MethodPost {
					mu.Lock()
					posters[role][r.RemoteAddr] = true
					mu.Unlock()
				}
				if chunked {
					w.(http.Flusher).Flush()
				}
				io.WriteString(w, reply)
			}))
			t.Cleanup(srv.Close)
			return srv
		}
		p := engine("prefill", `{"choices":[],"kv_transfer_params":{"remote_engine_id":"e","remote_block_ids":[1]}}`)
		d := engine("decode", `{"choices":[{"text":" b"}]}`)
		cfg := DefaultConfig()
		cfg.PDDisaggregation, cfg.VLLMPDDisaggregation = true, true
		cfg.Prefill = []PrefillSpec{{URL: p.URL, BootstrapPort: balancer.NoBootstrapPort}}
		cfg.Decode = []string{d.URL}
		base, srv := serveInProcess(t, cfg)
		tr := &http.Transport{}
		for i := range 20 {
			resp, err := (&http.Client{Transport: tr}).Post(base+"/v1/completions", "application/json", strings.NewReader(`{"prompt":"a"}`))
			if err != nil {
				t.Fatal(err)
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != 200 {
				t.Fatalf("request %d: %d %s", i, resp.StatusCode, b)
			}
		}
		tr.CloseIdleConnections()
		shutdown(t, srv)
		if np, nd := len(posters["prefill"]), len(posters["decode"]); np != 1 || nd != 1 {
			t.Errorf("chunked %v: 20 requests came from %d prefill and %d decode connections, want 1 each", chunked, np, nd)
		}
	}
}
