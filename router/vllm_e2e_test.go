package router_test

import (
	"encoding/json"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/pdrouter/pdrouter/mock/mockworker"
)

// vllmPD starts a router in vLLM PD mode over the given vLLM mocks, with
// round robin unless extra names a policy.
func vllmPD(t *testing.T, prefills []worker, decodes []worker, extra ...string) router {
	t.Helper()
	args := []string{"--vllm-pd-disaggregation", "--policy", "round_robin"}
	for _, p := range prefills {
		args = append(args, "--prefill", p.URL())
	}
	for _, d := range decodes {
		args = append(args, "--decode", d.URL())
	}
	return startRouter(t, append(args, extra...)...)
}

func (w worker) vllmHeld(t *testing.T) []mockworker.VLLMHeld {
	t.Helper()
	var out []mockworker.VLLMHeld
	getJSON(t, w.URL()+"/_mock/vllm/held", &out)
	return out
}

func (w worker) vllmPulls(t *testing.T) []mockworker.VLLMPull {
	t.Helper()
	var out []mockworker.VLLMPull
	getJSON(t, w.URL()+"/_mock/vllm/pulls", &out)
	return out
}

// fields decodes a recorded body's top-level members.
func fields(t *testing.T, body string) map[string]json.RawMessage {
	t.Helper()
	var m map[string]json.RawMessage
	if err := json.Unmarshal([]byte(body), &m); err != nil {
		t.Fatalf("recorded body %s: %v", body, err)
	}
	return m
}

var vllmRequestID = regexp.MustCompile(`^___prefill_addr_127\.0\.0\.1:(\d+)___decode_addr_127\.0\.0\.1:(\d+)_[0-9a-f]{32}$`)

const vllmAsk = `{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}`

// Both routes, streamed and not: prefill first with the prefill fields,
// then decode with the client's body and prefill's kv_transfer_params,
// under one X-Request-Id naming the pair; the client gets decode's answer.
func TestVLLMDispatchOrderAndFields(t *testing.T) {
	t.Parallel()
	p := startWorker(t, "vllm-prefill", "--prefill-delay", "50ms")
	d := startWorker(t, "vllm-decode", "--tokens", "4")
	r := vllmPD(t, []worker{p}, []worker{d})
	for _, c := range []struct{ path, body string }{
		{"/v1/chat/completions", `{"model":"mock","messages":[{"role":"user","content":"a b c"}],"max_completion_tokens":3,"zz":{"keep":[1,2.50]}}`},
		{"/v1/chat/completions", `{"model":"mock","messages":[{"role":"user","content":"a b c"}],"stream":true,"stream_options":{"include_usage":true},"min_tokens":2}`},
		{"/v1/completions", `{"model":"mock","prompt":"x y","max_tokens":3,"kv_transfer_params":{"client":"sent"}}`},
		{"/v1/completions", `{"model":"mock","prompt":"x y","stream":true,"min_tokens":2,"min_completion_tokens":2}`},
	} {
		resp, out := post(t, r.url+c.path, c.body, "X-Request-Id", "client-7")
		if resp.StatusCode != 200 {
			t.Fatalf("%s %s: %d %s", c.path, c.body, resp.StatusCode, out)
		}
		if got := resp.Header.Get("X-Request-Id"); got != "client-7" {
			t.Errorf("client's request id answered as %q", got)
		}
		client := fields(t, c.body)
		if _, stream := client["stream"]; stream {
			ev := sseEvents(out)
			if len(ev) < 3 || ev[len(ev)-1] != "[DONE]" || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
				t.Errorf("%s stream: %q", c.path, out)
			}
		} else if !strings.Contains(string(out), `"completion_tokens":3`) || strings.Contains(string(out), "kv_transfer_params") {
			t.Errorf("%s: not decode's answer of 3 tokens: %s", c.path, out)
		}
		pre, dec := p.requests(t), d.requests(t)
		pr, dr := pre[len(pre)-1], dec[len(dec)-1]
		// Decode after prefill's answer: it starts later and carries what
		// only that answer holds (remote_request_id, checked below). The
		// mock records a request's end after its reply is out, so the
		// decode may start before that record.
		if pr.StartedUnixNano+int64(50*time.Millisecond) > dr.StartedUnixNano {
			t.Errorf("decode started before prefill's 50 ms had passed")
		}
		id := pr.Headers["x-request-id"]
		if m := vllmRequestID.FindStringSubmatch(id); m == nil || m[1] != portOf(p) || m[2] != portOf(d) {
			t.Errorf("X-Request-Id %q does not name the pair", id)
		}
		if dr.Headers["x-request-id"] != id {
			t.Errorf("legs carry X-Request-Id %q and %q", id, dr.Headers["x-request-id"])
		}

		// Prefill: the client's body less what a prefill must not do.
		pf := fields(t, pr.Body)
		want := map[string]string{"max_tokens": "1", "stream": "false", "kv_transfer_params": vllmAsk}
		for k, v := range map[string]string{"max_completion_tokens": "1", "stream_options": "null", "min_tokens": "0", "min_completion_tokens": "0"} {
			if _, ok := client[k]; ok {
				want[k] = v
			}
		}
		for k, v := range client {
			if _, set := want[k]; !set {
				want[k] = string(v)
			}
		}
		if len(pf) != len(want) {
			t.Errorf("prefill body %s, want the members %v", pr.Body, want)
		}
		for k, v := range want {
			if string(pf[k]) != v {
				t.Errorf("prefill %s = %s, want %s", k, pf[k], v)
			}
		}
		// Decode: the client's body as sent, with prefill's params.
		df := fields(t, dr.Body)
		for k, v := range client {
			if k != "kv_transfer_params" && string(df[k]) != string(v) {
				t.Errorf("decode %s = %s, want the client's %s", k, df[k], v)
			}
		}
		var params map[string]any
		if err := json.Unmarshal(df["kv_transfer_params"], &params); err != nil || params["do_remote_prefill"] != true ||
			params["remote_port"] != mustAtof(portOf(p)) || params["remote_engine_id"] == nil || params["tp_size"] != 1.0 ||
			!strings.HasPrefix(fmt.Sprint(params["remote_request_id"]), "cmpl-"+id) {
			t.Errorf("decode kv_transfer_params %s, want the prefill's", df["kv_transfer_params"])
		}
		if _, own := client["kv_transfer_params"]; !own && !strings.HasPrefix(dr.Body, c.body[:len(c.body)-1]) {
			t.Errorf("decode body not the client's bytes in place:\n got %s\nfrom %s", dr.Body, c.body)
		}
	}
	if held := p.vllmHeld(t); len(held) != 0 {
		t.Errorf("KV left on the prefill: %+v", held)
	}
	for _, pull := range d.vllmPulls(t) {
		if pull.Error != "" {
			t.Errorf("decode pull failed: %s", pull.Error)
		}
	}
	if n := len(p.aborts(t)) + len(d.aborts(t)); n != 0 {
		t.Errorf("%d SGLang aborts sent to vLLM engines", n)
	}
	labels := []string{`backend_type="pd"`, `model="mock"`, `runtime="vllm"`} // the model from /v1/models
	if n := sample(t, r.metrics, "smg_pd_prefill_duration_seconds_count", labels...); n != 4 {
		t.Errorf("smg_pd_prefill_duration_seconds_count = %v, want 4", n)
	}
	if s := sample(t, r.metrics, "smg_pd_prefill_duration_seconds_sum", labels...); s < 4*0.05 {
		t.Errorf("smg_pd_prefill_duration_seconds_sum = %v, want at least 4 prefill delays", s)
	}
	if n := sample(t, r.metrics, "smg_pd_ttft_seconds_count", labels...); n != 4 {
		t.Errorf("smg_pd_ttft_seconds_count = %v, want 4", n)
	}
}

func TestVLLMRefusesRoutesItDoesNotServe(t *testing.T) {
	t.Parallel()
	p, d := startWorker(t, "vllm-prefill"), startWorker(t, "vllm-decode")
	r := vllmPD(t, []worker{p}, []worker{d})
	for _, path := range []string{"/generate", "/v1/rerank", "/v1/embeddings"} {
		resp, out := post(t, r.url+path, `{"text":"a","query":"q","documents":["d"],"input":"a"}`)
		if resp.StatusCode != 400 || !strings.HasPrefix(decodeError(t, out).Error.Code, "pd_unsupported_") {
			t.Errorf("%s: %d %s", path, resp.StatusCode, out)
		}
	}
	if n := len(p.requests(t)) + len(d.requests(t)); n != 0 {
		t.Errorf("%d requests reached the engines", n)
	}
}

// A prefill that fails is retried on another pair before decode hears of
// the request; a prefill failing every time ends with its error and no
// decode leg at all.
func TestVLLMFailingPrefill(t *testing.T) {
	t.Parallel()
	bad, good := startWorker(t, "vllm-prefill", "--status-code", "503"), startWorker(t, "vllm-prefill")
	d := startWorker(t, "vllm-decode", "--tokens", "2")
	r := vllmPD(t, []worker{bad, good}, []worker{d}, "--retry-initial-backoff-ms", "1", "--cb-failure-threshold", "100")
	for _, body := range []string{`{"prompt":"a b"}`, `{"prompt":"a b","stream":true}`} {
		for range 2 { // round robin starts on each prefill once
			resp, out := post(t, r.url+"/v1/completions", body)
			if resp.StatusCode != 200 {
				t.Fatalf("%s: %d %s", body, resp.StatusCode, out)
			}
		}
	}
	if n := len(bad.requests(t)); n == 0 {
		t.Fatal("the failing prefill was never tried")
	}
	if n := len(d.requests(t)); n != 4 {
		t.Errorf("decode got %d requests, want one per client request (4)", n)
	}
	for _, pull := range d.vllmPulls(t) {
		if pull.Error != "" {
			t.Errorf("decode pulled from a prefill that failed: %s", pull.Error)
		}
	}

	d2 := startWorker(t, "vllm-decode")
	r2 := vllmPD(t, []worker{bad}, []worker{d2}, "--retry-max-retries", "2", "--retry-initial-backoff-ms", "1")
	for _, body := range []string{`{"prompt":"a b"}`, `{"prompt":"a b","stream":true}`} {
		resp, out := post(t, r2.url+"/v1/completions", body)
		if resp.StatusCode != 503 || decodeError(t, out).Error.Code != "prefill_unavailable" {
			t.Errorf("%s: %d %s, want prefill's 503", body, resp.StatusCode, out)
		}
	}
	if n := len(d2.requests(t)); n != 0 {
		t.Errorf("decode got %d requests after prefill failed", n)
	}
}

// A decode failing after a good prefill: the retry starts over with a new
// prefill (never reusing the KV another decode may have read) and a new
// request id; the failed attempt's KV stays held on its prefill until
// vLLM's own timeout, which the README documents.
func TestVLLMFailingDecodeAfterGoodPrefill(t *testing.T) {
	t.Parallel()
	p := startWorker(t, "vllm-prefill")
	d := startWorker(t, "vllm-decode", "--fail-first-n", "1", "--tokens", "2")
	r := vllmPD(t, []worker{p}, []worker{d}, "--retry-initial-backoff-ms", "1", "--cb-failure-threshold", "100")
	resp, out := post(t, r.url+"/v1/chat/completions", `{"messages":[{"role":"user","content":"a b"}]}`)
	if resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, out)
	}
	pre, dec := p.requests(t), d.requests(t)
	if len(pre) != 2 || len(dec) != 2 || dec[0].Status != 500 || dec[1].Status != 200 {
		t.Fatalf("requests: prefill %d, decode %d (%+v); want 2 each, the first decode failing", len(pre), len(dec), dec)
	}
	if pre[0].Headers["x-request-id"] == pre[1].Headers["x-request-id"] {
		t.Error("the retry reused the failed attempt's request id")
	}
	for i := range 2 {
		if dec[i].Headers["x-request-id"] != pre[i].Headers["x-request-id"] {
			t.Errorf("attempt %d: decode carries %q, its prefill %q", i, dec[i].Headers["x-request-id"], pre[i].Headers["x-request-id"])
		}
	}
	if fields(t, dec[0].Body)["kv_transfer_params"] == nil || string(fields(t, dec[0].Body)["kv_transfer_params"]) == string(fields(t, dec[1].Body)["kv_transfer_params"]) {
		t.Error("the retried decode was sent the failed attempt's kv_transfer_params")
	}
	if held := p.vllmHeld(t); len(held) != 1 || held[0].XRequestID != pre[0].Headers["x-request-id"] {
		t.Errorf("held %+v, want the failed attempt's KV only", held)
	}

	// With no decode left to try, the client gets decode's error: JSON, or
	// one SSE error event for a stream.
	p2, d2 := startWorker(t, "vllm-prefill"), startWorker(t, "vllm-decode", "--status-code", "500")
	r2 := vllmPD(t, []worker{p2}, []worker{d2}, "--retry-max-retries", "2", "--retry-initial-backoff-ms", "1")
	resp, out = post(t, r2.url+"/v1/chat/completions", `{"messages":[{"role":"user","content":"a"}]}`)
	if resp.StatusCode != 500 || decodeError(t, out).Error.Code != "decode_internal_error" {
		t.Errorf("non-stream: %d %s", resp.StatusCode, out)
	}
	resp, out = post(t, r2.url+"/v1/chat/completions", `{"messages":[{"role":"user","content":"a"}],"stream":true}`)
	if ev := sseEvents(out); resp.StatusCode != 500 || len(ev) != 1 || !strings.Contains(ev[0], "decode_internal_error") {
		t.Errorf("stream: %d %q", resp.StatusCode, out)
	}
	if n := len(p2.requests(t)); n != 4 {
		t.Errorf("prefill got %d requests, want one per attempt (4)", n)
	}
}

// A client that leaves ends the leg under way, and vLLM, seeing its
// connection close, aborts: during prefill (no decode leg follows), during
// decode's wait for its first token, and mid-stream.
func TestVLLMClientLeaves(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name            string
		prefill, decode []string
		body            string
		firstByte       bool
		gone            string // the engine left holding the request
	}{
		{"during prefill", []string{"--prefill-delay", "10s"}, nil, `{"prompt":"a"}`, false, "prefill"},
		{"during prefill, streaming", []string{"--prefill-delay", "10s"}, nil, `{"prompt":"a","stream":true}`, false, "prefill"},
		{"before decode's first byte", nil, []string{"--prefill-delay", "10s"}, `{"prompt":"a","stream":true}`, false, "decode"},
		{"mid-stream", nil, []string{"--tokens", "200", "--token-delay", "50ms"}, `{"prompt":"a","stream":true}`, true, "decode"},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			p := startWorker(t, "vllm-prefill", c.prefill...)
			d := startWorker(t, "vllm-decode", c.decode...)
			r := vllmPD(t, []worker{p}, []worker{d})
			left := leave(t, r.url+"/v1/completions", c.body, c.firstByte, 300*time.Millisecond)
			w := map[string]worker{"prefill": p, "decode": d}[c.gone]
			w.waitStats(t, 2*time.Second, "client_gone", func(s mockworker.Stats) bool { return s.ClientGone == 1 })
			if since := time.Since(left); since > 2*time.Second {
				t.Errorf("the engine saw the client leave %v late", since)
			}
			if c.gone == "prefill" {
				time.Sleep(200 * time.Millisecond)
				if n := len(d.requests(t)); n != 0 {
					t.Errorf("decode got %d requests after the client left during prefill", n)
				}
				if held := p.vllmHeld(t); len(held) != 0 {
					t.Errorf("an aborted prefill holds KV: %+v", held)
				}
			}
		})
	}
}

func TestVLLMRequestTimeoutEndsTheLegUnderWay(t *testing.T) {
	t.Parallel()
	p := startWorker(t, "vllm-prefill", "--prefill-delay", "10s")
	d := startWorker(t, "vllm-decode")
	r := vllmPD(t, []worker{p}, []worker{d}, "--request-timeout-secs", "1")
	resp, out := post(t, r.url+"/v1/completions", `{"prompt":"a"}`)
	if resp.StatusCode != 504 {
		t.Fatalf("%d %s", resp.StatusCode, out)
	}
	p.waitStats(t, 2*time.Second, "client_gone", func(s mockworker.Stats) bool { return s.ClientGone == 1 })
	if n := len(d.requests(t)); n != 0 {
		t.Errorf("decode got %d requests after the timeout", n)
	}
}

// Each side's policy picks its worker: cache_aware keeps a prompt on the
// prefill that has its prefix, round robin alternates decodes.
func TestVLLMPolicies(t *testing.T) {
	t.Parallel()
	p1, p2 := startWorker(t, "vllm-prefill"), startWorker(t, "vllm-prefill")
	d1, d2 := startWorker(t, "vllm-decode", "--tokens", "1"), startWorker(t, "vllm-decode", "--tokens", "1")
	r := vllmPD(t, []worker{p1, p2}, []worker{d1, d2}, "--prefill-policy", "cache_aware", "--decode-policy", "round_robin",
		"--cache-threshold", "0.3", "--balance-abs-threshold", "1000")
	prompts := []string{"the quick brown fox jumps over", "lorem ipsum dolor sit amet consectetur"}
	home := map[string]string{}
	for round := range 3 {
		for _, pr := range prompts {
			resp, out := post(t, r.url+"/v1/completions", `{"prompt":"`+pr+` `+strconv.Itoa(round)+`"}`)
			if resp.StatusCode != 200 {
				t.Fatalf("%d %s", resp.StatusCode, out)
			}
			var at string
			for _, w := range []worker{p1, p2} {
				if rs := w.requests(t); len(rs) > 0 && strings.Contains(rs[len(rs)-1].Body, pr+" "+strconv.Itoa(round)) {
					at = w.Addr
				}
			}
			if home[pr] == "" {
				home[pr] = at
			} else if home[pr] != at {
				t.Errorf("cache_aware moved %q from %s to %s", pr, home[pr], at)
			}
		}
	}
	if n1, n2 := len(d1.requests(t)), len(d2.requests(t)); n1 != 3 || n2 != 3 {
		t.Errorf("round robin decodes got %d and %d, want 3 and 3", n1, n2)
	}
	for _, policy := range [][]string{{"--policy", "random"}, {"--policy", "power_of_two"}, {"--policy", "prefix_hash"},
		{"--policy", "consistent_hashing"}, {"--policy", "manual"}, {"--prefill-policy", "bucket"}} {
		r := vllmPD(t, []worker{p1, p2}, []worker{d1, d2}, policy...)
		if resp, out := post(t, r.url+"/v1/chat/completions", `{"messages":[{"role":"user","content":"hi"}]}`); resp.StatusCode != 200 {
			t.Errorf("%s: %d %s", policy, resp.StatusCode, out)
		}
	}
}

// An open breaker takes a prefill out of the picks, as in SGLang's mode.
func TestVLLMBreakerSkipsAFailingPrefill(t *testing.T) {
	t.Parallel()
	bad, good := startWorker(t, "vllm-prefill", "--status-code", "500"), startWorker(t, "vllm-prefill")
	d := startWorker(t, "vllm-decode", "--tokens", "1")
	r := vllmPD(t, []worker{bad, good}, []worker{d}, "--cb-failure-threshold", "1", "--cb-timeout-duration-secs", "60",
		"--retry-initial-backoff-ms", "1")
	for range 6 {
		if resp, out := post(t, r.url+"/v1/completions", `{"prompt":"a"}`); resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, out)
		}
	}
	if n := len(bad.requests(t)); n != 1 {
		t.Errorf("the failing prefill got %d requests, want 1 before its breaker opened", n)
	}
}

func portOf(w worker) string { return w.Addr[strings.LastIndexByte(w.Addr, ':')+1:] }

func mustAtof(s string) float64 {
	f, _ := strconv.ParseFloat(s, 64)
	return f
}

// A prefill that dies is health gated: with no retries to hide it, no
// request fails once the checks noticed. Admission bounds requests before
// either leg.
func TestVLLMHealthGatingAndAdmission(t *testing.T) {
	t.Parallel()
	dead, well := startWorker(t, "vllm-prefill"), startWorker(t, "vllm-prefill", "--prefill-delay", "300ms")
	d := startWorker(t, "vllm-decode", "--tokens", "1")
	r := vllmPD(t, []worker{dead, well}, []worker{d}, "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
		"--health-check-timeout-secs", "1", "--disable-retries",
		"--max-concurrent-requests", "1", "--queue-size", "0", "--rate-limit-tokens-per-second", "0.001")
	dead.Stop()
	balWaitHealth(t, r, dead.URL(), false, 15*time.Second)
	for i := range 4 { // round robin would have sent two to the dead prefill
		if resp, out := post(t, r.url+"/v1/completions", `{"prompt":"a"}`); resp.StatusCode != 200 {
			t.Fatalf("request %d: %d %s", i, resp.StatusCode, out)
		}
	}
	first := balAsync(r.url+"/v1/completions", `{"prompt":"a"}`)
	well.waitStats(t, 5*time.Second, "a request in flight", func(s mockworker.Stats) bool { return s.InFlight == 1 })
	resp, out := post(t, r.url+"/v1/completions", `{"prompt":"b"}`)
	if resp.StatusCode != 429 {
		t.Errorf("second request at once: %d %s, want 429", resp.StatusCode, out)
	}
	if res := <-first; res.code != 200 {
		t.Errorf("first request: %d %s", res.code, res.body)
	}
	if n, m := len(well.requests(t)), len(d.requests(t)); n != 5 || m != 5 {
		t.Errorf("legs sent: %d prefill, %d decode; want 5 and 5", n, m)
	}
}
