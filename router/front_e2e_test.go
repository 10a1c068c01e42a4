package router_test

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"

	"github.com/pdrouter/pdrouter/testkit/testenv"
)

func TestFrontEndpoints(t *testing.T) {
	t.Parallel()
	p, d := startWorker(t, "prefill", "--model", "llama"), startWorker(t, "decode", "--model", "llama")
	r := pd(t, []worker{p}, []worker{d})
	idPattern := regexp.MustCompile(`^req-[A-Za-z0-9]{24}$`)
	for path, check := range map[string]func(*http.Response, []byte) string{
		"/health":   func(_ *http.Response, b []byte) string { return want(string(b) == "OK", b) },
		"/liveness": func(_ *http.Response, b []byte) string { return want(string(b) == "OK", b) },
		"/readiness": func(_ *http.Response, b []byte) string {
			return want(strings.Contains(string(b), `"status":"ready"`) && strings.Contains(string(b), `"healthy_workers":2`), b)
		},
		"/health_generate": func(_ *http.Response, b []byte) string { return want(len(b) > 0, b) },
		"/v1/models": func(_ *http.Response, b []byte) string {
			return want(strings.Contains(string(b), `"id":"llama"`) && strings.Contains(string(b), `"object":"list"`), b)
		},
		"/get_model_info": func(_ *http.Response, b []byte) string { return want(strings.Contains(string(b), "model_path"), b) },
		"/get_server_info": func(resp *http.Response, b []byte) string {
			return want(string(b) == `{"router_manager":true,"routers_count":1,"workers_count":2}`, b)
		},
		"/server_info": func(_ *http.Response, b []byte) string {
			return want(strings.Contains(string(b), `"workers_count":2`), b)
		},
		"/get_loads": func(_ *http.Response, b []byte) string {
			var v struct {
				Loads []struct {
					WorkerType string `json:"worker_type"`
					Load       int64  `json:"load"`
				} `json:"loads"`
				Successful int `json:"successful"`
			}
			return want(json.Unmarshal(b, &v) == nil && v.Successful == 2 && len(v.Loads) == 2 && v.Loads[0].Load >= 0, b)
		},
		"/engine_metrics": func(_ *http.Response, b []byte) string {
			return want(strings.Contains(string(b), `worker_addr="`+p.URL()+`"`) && strings.Contains(string(b), `worker_addr="`+d.URL()+`"`), b)
		},
		"/workers": func(_ *http.Response, b []byte) string {
			return want(strings.Contains(string(b), `"total":2`) && strings.Contains(string(b), `"prefill_count":1`), b)
		},
	} {
		resp, body := get(t, r.url+path)
		if resp.StatusCode != 200 {
			t.Errorf("%s: status %d: %s", path, resp.StatusCode, body)
			continue
		}
		if msg := check(resp, body); msg != "" {
			t.Errorf("%s: %s", path, msg)
		}
		if id := resp.Header.Get("X-Request-Id"); !idPattern.MatchString(id) {
			t.Errorf("%s: x-request-id %q", path, id)
		}
	}
	resp, body := post(t, r.url+"/flush_cache", "")
	if resp.StatusCode != 200 || !strings.Contains(string(body), `"total_workers":2`) || strings.Contains(string(body), `"failed":[[`) {
		t.Errorf("flush_cache: %d %s", resp.StatusCode, body)
	}
	if resp, _ := get(t, r.url+"/no/such/path"); resp.StatusCode != 404 {
		t.Errorf("unknown path: %d", resp.StatusCode)
	}

	// Prometheus: sglang-router's smg_* names on their own listener.
	// A request's record is emitted once its prefill leg is done too, which
	// may be after the reply: poll for the selection it counts.
	post(t, r.url+"/generate", `{"text":"count me"}`)
	var metrics []byte
	for range 100 {
		if _, metrics = get(t, r.metrics); strings.Contains(string(metrics), "smg_worker_selection_total") {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	for _, name := range []string{"smg_http_requests_total", "smg_http_responses_total", "smg_router_requests_total",
		"smg_worker_requests_active", "smg_worker_health", "smg_worker_cb_state", "smg_worker_selection_total"} {
		if !strings.Contains(string(metrics), name) {
			t.Errorf("metrics lack %s", name)
		}
	}
}

func want(ok bool, b []byte) string {
	if ok {
		return ""
	}
	return "unexpected body: " + string(b)
}

func TestRequestIDsAndForwardedHeaders(t *testing.T) {
	t.Parallel()
	p, d := startWorker(t, "prefill"), startWorker(t, "decode", "--tokens", "1")
	r := pd(t, []worker{p}, []worker{d})
	resp, _ := post(t, r.url+"/v1/chat/completions", `{"model":"mock","messages":[{"role":"user","content":"x"}]}`,
		"X-Request-Id", "my-id-1", "Traceparent", "00-abc-def-01", "Cookie", "secret", "X-Request-Id-Extra", "e")
	if got := resp.Header.Get("X-Request-Id"); got != "my-id-1" {
		t.Errorf("echoed id %q", got)
	}
	reqs := d.requests(t)
	h := reqs[len(reqs)-1].Headers
	if h["x-request-id"] != "my-id-1" || h["traceparent"] != "00-abc-def-01" || h["x-request-id-extra"] != "e" {
		t.Errorf("whitelisted headers not forwarded: %v", h)
	}
	if _, leaked := h["cookie"]; leaked {
		t.Errorf("cookie forwarded: %v", h)
	}
	for path, prefix := range map[string]string{"/v1/chat/completions": "chatcmpl-", "/v1/completions": "cmpl-", "/generate": "gnt-"} {
		resp, _ := post(t, r.url+path, `{"model":"mock","text":"a","prompt":"a","messages":[{"role":"user","content":"a"}]}`)
		if id := resp.Header.Get("X-Request-Id"); !strings.HasPrefix(id, prefix) || len(id) != len(prefix)+24 {
			t.Errorf("%s: generated id %q", path, id)
		}
	}
}

func TestBadRequests(t *testing.T) {
	t.Parallel()
	p, d := startWorker(t, "prefill"), startWorker(t, "decode")
	r := pd(t, []worker{p}, []worker{d}, "--max-payload-size", "2048", "--api-key", "sekret")
	auth := []string{"Authorization", "Bearer sekret"}
	for name, c := range map[string]struct {
		body   string
		header []string
		status int
		code   string
	}{
		"missing key":   {`{"text":"x"}`, nil, 401, "unauthorized"},
		"wrong key":     {`{"text":"x"}`, []string{"Authorization", "Bearer nope"}, 401, "unauthorized"},
		"bad JSON":      {`{"text":`, auth, 400, "json_parse_error"},
		"not an object": {`[{"text":"x"}]`, auth, 400, "json_parse_error"},
		"oversized":     {`{"text":"` + strings.Repeat("a", 4096) + `"}`, auth, 413, "payload_too_large"},
		"embeddings":    {`{"input":"x"}`, auth, 400, "pd_unsupported_embeddings"},
	} {
		path := "/generate"
		if name == "embeddings" {
			path = "/v1/embeddings"
		}
		resp, body := post(t, r.url+path, c.body, c.header...)
		if resp.StatusCode != c.status {
			t.Errorf("%s: status %d, want %d: %s", name, resp.StatusCode, c.status, body)
			continue
		}
		if e := decodeError(t, body); e.Error.Code != c.code || resp.Header.Get("X-SMG-Error-Code") != c.code {
			t.Errorf("%s: code %q header %q, want %q", name, e.Error.Code, resp.Header.Get("X-SMG-Error-Code"), c.code)
		}
		if resp.Header.Get("X-Request-Id") == "" {
			t.Errorf("%s: no x-request-id", name)
		}
	}
	// A body without a content type is accepted, as SGLang servers do.
	req, _ := http.NewRequest("POST", r.url+"/generate", strings.NewReader(`{"text":"no type"}`))
	req.Header.Set("Authorization", "Bearer sekret")
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Errorf("no content type: status %d", resp.StatusCode)
	}
	if resp, _ := get(t, r.url+"/generate", auth...); resp.StatusCode != 405 {
		t.Errorf("GET /generate: %d", resp.StatusCode)
	}
	if s := d.stats(t).Errors; s != 0 {
		t.Errorf("bad requests reached the decode worker: %d errors", s)
	}
}

func TestRegularMode(t *testing.T) {
	t.Parallel()
	w1, w2 := startWorker(t, "regular", "--tokens", "3"), startWorker(t, "regular", "--tokens", "3")
	r := startRouter(t, "--worker-urls", w1.URL(), w2.URL(), "--policy", "round_robin")
	var ids []string
	for range 4 {
		resp, body := post(t, r.url+"/v1/completions", `{"model":"mock","prompt":"hi"}`)
		if resp.StatusCode != 200 {
			t.Fatalf("status %d: %s", resp.StatusCode, body)
		}
		ids = append(ids, resp.Header.Get("X-Worker-Id"))
	}
	if ids[0] == ids[1] || ids[0] != ids[2] || ids[1] != ids[3] {
		t.Errorf("round robin over two workers gave %v", ids)
	}
	for _, path := range []string{"/v1/embeddings", "/v1/classify", "/v1/responses", "/v1/rerank"} {
		resp, body := post(t, r.url+path, `{"model":"mock","input":"x","query":"q","documents":["a","b"]}`)
		if resp.StatusCode != 200 {
			t.Errorf("%s: status %d: %s", path, resp.StatusCode, body)
		}
	}
	reqs := w1.requests(t)
	if last := reqs[len(reqs)-1]; len(last.BootstrapRoom) != 0 || strings.Contains(last.Body, "bootstrap") {
		t.Errorf("regular mode injected bootstrap fields: %s", last.Body)
	}
	resp, body := post(t, r.url+"/generate", `{"text":"s","stream":true}`)
	if evs := sseEvents(body); resp.StatusCode != 200 || len(evs) < 2 || evs[len(evs)-1] != "[DONE]" {
		t.Errorf("stream: %d %q", resp.StatusCode, body)
	}
}

func TestRegularModePassesWorkerErrorsThrough(t *testing.T) {
	t.Parallel()
	w := startWorker(t, "regular", "--status-code", "422")
	r := startRouter(t, "--worker-urls", w.URL(), "--policy", "random")
	resp, body := post(t, r.url+"/generate", `{"text":"x"}`)
	if resp.StatusCode != 422 || !strings.Contains(string(body), `"object":"error"`) {
		t.Errorf("status %d body %s", resp.StatusCode, body)
	}
}

func TestOpenAIClientStreamsThroughPD(t *testing.T) {
	t.Parallel()
	p, d := startWorker(t, "prefill"), startWorker(t, "decode", "--tokens", "7")
	r := pd(t, []worker{p}, []worker{d})
	c := openai.NewClient(option.WithBaseURL(r.url+"/v1/"), option.WithAPIKey("unused"), option.WithMaxRetries(0))
	stream := c.Chat.Completions.NewStreaming(context.Background(), openai.ChatCompletionNewParams{
		Model:    "mock",
		Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("hello there")},
	})
	var text strings.Builder
	chunks := 0
	for stream.Next() {
		ch := stream.Current()
		if len(ch.Choices) > 0 {
			text.WriteString(ch.Choices[0].Delta.Content)
		}
		chunks++
	}
	if err := stream.Err(); err != nil {
		t.Fatal(err)
	}
	if got := len(strings.Fields(text.String())); got != 7 || chunks < 8 {
		t.Errorf("got %d tokens in %d chunks: %q", got, chunks, text.String())
	}
	// Non-streaming through the SDK too.
	cc, err := c.Chat.Completions.New(context.Background(), openai.ChatCompletionNewParams{
		Model: "mock", Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("again")},
	})
	if err != nil || len(cc.Choices) != 1 || len(strings.Fields(cc.Choices[0].Message.Content)) != 7 {
		t.Errorf("non-stream: %v %+v", err, cc)
	}
}

func TestCORS(t *testing.T) {
	t.Parallel()
	w := startWorker(t, "regular")
	r := startRouter(t, "--worker-urls", w.URL(), "--cors-allowed-origins", "http://app.example")
	req, _ := http.NewRequest("OPTIONS", r.url+"/v1/chat/completions", nil)
	req.Header.Set("Origin", "http://app.example")
	req.Header.Set("Access-Control-Request-Method", "POST")
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 204 || resp.Header.Get("Access-Control-Allow-Origin") != "http://app.example" ||
		resp.Header.Get("Access-Control-Max-Age") != "3600" {
		t.Errorf("preflight: %d %v", resp.StatusCode, resp.Header)
	}
	resp, _ = get(t, r.url+"/health", "Origin", "http://evil.example")
	if resp.Header.Get("Access-Control-Allow-Origin") != "" {
		t.Errorf("disallowed origin got CORS headers")
	}
}

func TestGracefulShutdownDrainsStreams(t *testing.T) {
	t.Parallel()
	p, d := startWorker(t, "prefill"), startWorker(t, "decode", "--tokens", "20", "--token-delay", "50ms")
	r := pd(t, []worker{p}, []worker{d}, "--shutdown-grace-period-secs", "30")
	resp, err := client.Post(r.url+"/generate", "application/json", strings.NewReader(`{"text":"long","stream":true}`))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	br := bufio.NewReader(resp.Body)
	if _, err := br.ReadString('\n'); err != nil {
		t.Fatal(err)
	}
	if err := r.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	rest, err := io.ReadAll(br)
	if err != nil {
		t.Fatalf("stream cut by shutdown: %v", err)
	}
	if !strings.Contains(string(rest), "data: [DONE]") {
		t.Errorf("stream did not finish: %s", rest)
	}
	if code := r.Wait(10 * time.Second); code != 0 {
		t.Errorf("router exit code %d after drain", code)
	}
}

func TestCLI(t *testing.T) {
	t.Parallel()
	bin := testenv.Binary(t, "pdrouter")
	for _, c := range []struct {
		args []string
		code int
		out  string
	}{
		{[]string{"--no-such-flag"}, 2, "unrecognized arguments: --no-such-flag"},
		{[]string{"--port", "x"}, 2, "invalid int value: 'x'"},
		{[]string{"--policy", "fastest"}, 2, "invalid choice: 'fastest'"},
		{[]string{"--pd-disaggregation", "--prefill", "http://p:1", "abc"}, 2, "Invalid bootstrap port: abc"},
		{[]string{"--worker-urls", "ftp://w"}, 2, "Configuration validation failed"},
		{[]string{"--cache-threshold", "2"}, 2, "cache_threshold must be in [0, 1]"},
		{[]string{"--pd-disaggregation", "--prefill", "http://p:1", "--decode", "http://d:1", "--decode-policy", "bucket"}, 2, "invalid choice: 'bucket'"},
		{[]string{"--help"}, 0, "--prefill URL [URL ...]"},
	} {
		out, err := exec.Command(bin, c.args...).CombinedOutput()
		code := 0
		if ee, ok := err.(*exec.ExitError); ok {
			code = ee.ExitCode()
		}
		if code != c.code || !strings.Contains(string(out), c.out) {
			t.Errorf("%v: exit %d output %q; want exit %d containing %q", c.args, code, out, c.code, c.out)
		}
	}
	// An accepted but unimplemented flag is logged once, not fatal; with
	// --log-dir the log also goes to DIR/smg.log.
	w := startWorker(t, "regular")
	dir := t.TempDir()
	r := startRouter(t, "--worker-urls", w.URL(), "--reasoning-parser", "deepseek-r1", "--log-level", "info", "--log-dir", dir)
	if !strings.Contains(r.Output(), "--reasoning-parser") || !strings.Contains(r.Output(), "ignored") {
		t.Errorf("ignored flag not logged:\n%s", r.Output())
	}
	if b, err := os.ReadFile(filepath.Join(dir, "smg.log")); err != nil || !strings.Contains(string(b), "pdrouter listening") {
		t.Errorf("log file: %v %q", err, b)
	}
	// --log-level warn hides info lines.
	quiet := startRouter(t, "--worker-urls", w.URL())
	if strings.Contains(quiet.Output(), "pdrouter listening") {
		t.Errorf("info logged at --log-level warn:\n%s", quiet.Output())
	}
}

func TestWorkerAdminAPI(t *testing.T) {
	t.Parallel()
	w1, w2 := startWorker(t, "regular"), startWorker(t, "regular")
	r := startRouter(t, "--worker-urls", w1.URL())
	resp, body := post(t, r.url+"/workers", `{"url":"`+w2.URL()+`"}`)
	var added struct {
		WorkerID string `json:"worker_id"`
		Location string `json:"location"`
	}
	if resp.StatusCode != 202 || json.Unmarshal(body, &added) != nil || len(added.WorkerID) != 36 ||
		resp.Header.Get("Location") != "/workers/"+added.WorkerID {
		t.Fatalf("POST /workers: %d %s", resp.StatusCode, body)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		_, body = get(t, r.url+"/workers/"+added.WorkerID)
		if strings.Contains(string(body), `"is_healthy":true`) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("worker never became healthy: %s", body)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if resp, _ := get(t, r.url+"/workers/not-a-uuid"); resp.StatusCode != 400 {
		t.Errorf("bad id: %d", resp.StatusCode)
	}
	if resp, _ := get(t, r.url+"/workers/00000000-0000-0000-0000-000000000000"); resp.StatusCode != 404 {
		t.Errorf("unknown id: %d", resp.StatusCode)
	}
	// slime/miles delete by URL-encoded URL.
	req, _ := http.NewRequest("DELETE", r.url+"/workers/"+url.PathEscape(w2.URL()), nil)
	dresp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	dresp.Body.Close()
	if dresp.StatusCode != 202 {
		t.Errorf("DELETE by URL: %d", dresp.StatusCode)
	}
	// The legacy API.
	resp, body = post(t, r.url+"/add_worker?url="+url.QueryEscape(w2.URL()), "")
	if resp.StatusCode != 200 || !strings.Contains(string(body), "Successfully added") {
		t.Errorf("add_worker: %d %s", resp.StatusCode, body)
	}
	_, body = get(t, r.url+"/list_workers")
	if !strings.Contains(string(body), w1.URL()) || !strings.Contains(string(body), w2.URL()) {
		t.Errorf("list_workers: %s", body)
	}
	resp, _ = post(t, r.url+"/remove_worker?url="+url.QueryEscape(w2.URL()), "")
	_, body = get(t, r.url+"/workers")
	if resp.StatusCode != 200 || !strings.Contains(string(body), `"total":1`) {
		t.Errorf("remove_worker: %d, then %s", resp.StatusCode, body)
	}
}
