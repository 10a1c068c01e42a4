package mockworker

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"
)

func TestGenerateShape(t *testing.T) {
	h := start(t, Config{Tokens: 4})
	code, hdr, b := h.post("/generate", `{"text":"the quick brown fox","sampling_params":{"max_new_tokens":3},"return_logprob":true}`)
	if code != 200 || hdr.Get("X-Worker-Id") != h.s.WorkerID() || !strings.HasPrefix(h.s.WorkerID(), "worker-") {
		t.Fatalf("%d %v %s", code, hdr, b)
	}
	m := decodeObj(t, b)
	if m["worker_id"] != h.s.WorkerID() {
		t.Errorf("worker_id = %v", m["worker_id"])
	}
	if got := num(t, m, "meta_info", "completion_tokens"); got != 3 {
		t.Errorf("completion_tokens = %d, want 3 (max_new_tokens lowers --tokens)", got)
	}
	if num(t, m, "meta_info", "prompt_tokens") != 4 || arrLen(t, m, "output_ids") != 3 {
		t.Errorf("counts: %s", b)
	}
	if fr := path(t, m, "meta_info", "finish_reason"); fr.(map[string]any)["type"] != "length" || num(t, fr, "length") != 3 {
		t.Errorf("finish_reason = %v", fr)
	}
	if len(strings.Fields(m["text"].(string))) != 3 {
		t.Errorf("text = %q", m["text"])
	}
	// Regular role: input logprobs cover the prompt, first logprob null.
	if arrLen(t, m, "meta_info", "input_token_logprobs") != 4 || path(t, m, "meta_info", "input_token_logprobs", 0, 0) != nil {
		t.Errorf("input_token_logprobs: %s", b)
	}
	if arrLen(t, m, "meta_info", "output_token_logprobs") != 3 || arrLen(t, m, "meta_info", "output_token_logprobs", 0) != 3 {
		t.Errorf("output_token_logprobs: %s", b)
	}
	for _, k := range []string{"id", "e2e_latency"} {
		path(t, m, "meta_info", k)
	}
	// Deterministic: the same prompt gives the same text; another does not.
	again := h.postJSON("/generate", `{"text":"the quick brown fox","sampling_params":{"max_new_tokens":3}}`)
	other := h.postJSON("/generate", `{"text":"another prompt","sampling_params":{"max_new_tokens":3}}`)
	if again["text"] != m["text"] || other["text"] == m["text"] {
		t.Errorf("text not deterministic from the prompt: %v %v %v", m["text"], again["text"], other["text"])
	}
	if _, ok := again["meta_info"].(map[string]any)["input_token_logprobs"]; ok {
		t.Error("logprobs without return_logprob")
	}
}

func TestGenerateBatch(t *testing.T) {
	h := start(t, Config{Tokens: 2})
	for _, body := range []string{`{"input_ids":[[1,2,3],[4]]}`, `{"text":["a b c","d"]}`} {
		code, _, b := h.post("/generate", body)
		var arr []map[string]any
		if err := json.Unmarshal(b, &arr); code != 200 || err != nil || len(arr) != 2 {
			t.Fatalf("%s: %d %s", body, code, b)
		}
		if num(t, arr[0], "meta_info", "prompt_tokens") != 3 || num(t, arr[1], "meta_info", "prompt_tokens") != 1 {
			t.Errorf("%s: prompt_tokens: %s", body, b)
		}
		if arr[0]["worker_id"] != h.s.WorkerID() || arr[0]["meta_info"].(map[string]any)["id"] == arr[1]["meta_info"].(map[string]any)["id"] {
			t.Errorf("%s: %s", body, b)
		}
	}
	// Per-element sampling params.
	code, _, b := h.post("/generate", `{"input_ids":[[1],[2]],"sampling_params":[{"max_new_tokens":1},{"max_new_tokens":0}]}`)
	var arr []map[string]any
	if err := json.Unmarshal(b, &arr); code != 200 || err != nil || num(t, arr[0], "meta_info", "completion_tokens") != 1 || num(t, arr[1], "meta_info", "completion_tokens") != 0 {
		t.Fatalf("%d %s", code, b)
	}
}

func TestChatCompletionShape(t *testing.T) {
	h := start(t, Config{Model: "served"})
	code, hdr, b := h.post("/v1/chat/completions", `{"model":"m1","messages":[{"role":"system","content":"be brief"},{"role":"user","content":[{"type":"text","text":"hi there"}]}],"max_completion_tokens":5,"max_tokens":7,"n":2,"logprobs":true,"top_logprobs":2}`)
	if code != 200 || hdr.Get("X-Worker-Id") == "" {
		t.Fatalf("%d %s", code, b)
	}
	m := decodeObj(t, b)
	if m["object"] != "chat.completion" || m["model"] != "m1" || !strings.HasPrefix(m["id"].(string), "chatcmpl-") || m["worker_id"] != h.s.WorkerID() {
		t.Errorf("envelope: %s", b)
	}
	num(t, m, "created")
	if arrLen(t, m, "choices") != 2 {
		t.Fatalf("choices: %s", b)
	}
	c := path(t, m, "choices", 1)
	if num(t, c, "index") != 1 || path(t, c, "message", "role") != "assistant" || path(t, c, "finish_reason") != "length" {
		t.Errorf("choice: %v", c)
	}
	if path(t, m, "choices", 0, "message", "content") == path(t, c, "message", "content") {
		t.Error("choices should differ")
	}
	if arrLen(t, c, "logprobs", "content") != 5 || arrLen(t, c, "logprobs", "content", 0, "top_logprobs") != 2 {
		t.Errorf("logprobs: %v", c)
	}
	// 4 prompt words over both messages, 2 choices x 5 tokens.
	if num(t, m, "usage", "prompt_tokens") != 4 || num(t, m, "usage", "completion_tokens") != 10 || num(t, m, "usage", "total_tokens") != 14 {
		t.Errorf("usage: %v", m["usage"])
	}
	// Default model name when the request has none.
	if m := h.postJSON("/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}]}`); m["model"] != "served" || path(t, m, "choices", 0, "logprobs") != nil {
		t.Errorf("%v", m)
	}
}

func TestCompletionShape(t *testing.T) {
	h := start(t, Config{Tokens: 3})
	m := h.postJSON("/v1/completions", `{"model":"m","prompt":["a b","c d e"],"logprobs":1}`)
	if m["object"] != "text_completion" || !strings.HasPrefix(m["id"].(string), "cmpl-") || arrLen(t, m, "choices") != 2 {
		t.Fatalf("%v", m)
	}
	if num(t, m, "usage", "prompt_tokens") != 5 || num(t, m, "usage", "completion_tokens") != 6 {
		t.Errorf("usage %v", m["usage"])
	}
	lp := path(t, m, "choices", 1, "logprobs")
	if arrLen(t, lp, "tokens") != 3 || arrLen(t, lp, "token_logprobs") != 3 || arrLen(t, lp, "text_offset") != 3 || arrLen(t, lp, "top_logprobs") != 3 {
		t.Errorf("logprobs %v", lp)
	}
	for _, body := range []string{`{"prompt":[1,2,3]}`, `{"prompt":[[1],[2,3]]}`, `{"prompt":"x","n":3}`} {
		if m := h.postJSON("/v1/completions", body); path(t, m, "choices", 0, "logprobs") != nil {
			t.Errorf("%s: %v", body, m)
		}
	}
}

func TestAuxEndpoints(t *testing.T) {
	h := start(t, Config{})
	e := h.postJSON("/v1/embeddings", `{"model":"m","input":["a b","c"]}`)
	if e["object"] != "list" || arrLen(t, e, "data") != 2 || arrLen(t, e, "data", 0, "embedding") != embeddingDim || num(t, e, "usage", "prompt_tokens") != 3 {
		t.Errorf("embeddings %v", e)
	}
	c := h.postJSON("/v1/classify", `{"input":"text"}`)
	if arrLen(t, c, "data") != 1 || arrLen(t, c, "data", 0, "probs") != 2 {
		t.Errorf("classify %v", c)
	}
	for _, p := range []string{"/v1/rerank", "/rerank"} {
		code, _, b := h.post(p, `{"query":"q","documents":["d1","d2","d3"]}`)
		var r []map[string]any
		if err := json.Unmarshal(b, &r); code != 200 || err != nil || len(r) != 3 {
			t.Fatalf("%s: %d %s", p, code, b)
		}
		if r[0]["score"].(float64) < r[1]["score"].(float64) || r[1]["score"].(float64) < r[2]["score"].(float64) {
			t.Errorf("rerank not sorted: %s", b)
		}
	}
	r := h.postJSON("/v1/responses", `{"input":[{"role":"user","content":"hello"}],"max_output_tokens":2}`)
	if r["object"] != "response" || r["status"] != "completed" || num(t, r, "usage", "output_tokens") != 2 || path(t, r, "output", 0, "content", 0, "type") != "output_text" {
		t.Errorf("responses %v", r)
	}
}

func TestInfoEndpoints(t *testing.T) {
	h := start(t, Config{Role: RolePrefill, Model: "llama"})
	code, b := h.get("/v1/models")
	if m := decodeObj(t, b); code != 200 || m["object"] != "list" || path(t, m, "data", 0, "id") != "llama" || path(t, m, "data", 0, "owned_by") != "sglang" || path(t, m, "data", 0, "object") != "model" {
		t.Errorf("models %d %s", code, b)
	}
	_, b = h.get("/get_model_info")
	if m := decodeObj(t, b); m["model_path"] != "llama" || m["is_generation"] != true || m["tokenizer_path"] == nil {
		t.Errorf("model info %s", b)
	}
	for _, p := range []string{"/get_server_info", "/server_info"} {
		_, b = h.get(p)
		m := decodeObj(t, b)
		if m["served_model_name"] != "llama" || m["model_path"] != "llama" || m["disaggregation_mode"] != "prefill" || num(t, m, "dp_size") != 1 || num(t, m, "tp_size") != 1 {
			t.Errorf("%s: %s", p, b)
		}
	}
	for _, p := range []string{"/health", "/health_generate"} {
		if code, _ := h.get(p); code != 200 {
			t.Errorf("%s: %d", p, code)
		}
	}
	if code, _, _ := h.post("/flush_cache", ""); code != 200 {
		t.Errorf("flush_cache %d", code)
	}
	code, b = h.get("/metrics")
	if code != 200 || !strings.Contains(string(b), "# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs{model_name=\"llama\"} 0\n") {
		t.Errorf("metrics %s", b)
	}
	if code, _ := h.get("/nope"); code != http.StatusNotFound {
		t.Errorf("unknown path: %d", code)
	}
	if code, _ := h.get("/generate"); code != http.StatusMethodNotAllowed {
		t.Errorf("GET /generate: %d", code)
	}
	if _, b := h.get("/get_server_info"); decodeObj(t, b)["disaggregation_mode"] != "prefill" {
		t.Error(string(b))
	}
	r := start(t, Config{})
	if _, b := r.get("/server_info"); decodeObj(t, b)["disaggregation_mode"] != "null" {
		t.Errorf("regular: %s", b)
	}
}

func TestBadInput(t *testing.T) {
	h := start(t, Config{})
	for _, c := range []struct{ path, body string }{
		{"/generate", `not json`},
		{"/generate", `[1,2]`},
		{"/generate", `{}`},
		{"/generate", `{"text":"a","input_ids":[1]}`},
		{"/generate", `{"text":5}`},
		{"/generate", `{"input_ids":["x"]}`},
		{"/generate", `{"text":"a","stream":"yes"}`},
		{"/generate", `{"text":"a","sampling_params":{"max_new_tokens":"3"}}`},
		{"/generate", `{"text":"a","sampling_params":{"max_new_tokens":-1}}`},
		{"/generate", `{"text":["a","b"],"sampling_params":[{}]}`},
		{"/generate", `{"text":"a","bootstrap_host":"h","bootstrap_room":-1}`},
		{"/generate", `{"text":"a","bootstrap_host":1,"bootstrap_room":1}`},
		{"/generate", `{"text":"a","bootstrap_host":"h","bootstrap_room":1,"bootstrap_port":"x"}`},
		{"/generate", `{"text":["a","b"],"bootstrap_host":"h","bootstrap_room":[1,2,3]}`},
		{"/v1/chat/completions", `{"messages":[]}`},
		{"/v1/chat/completions", `{"messages":[{"role":"user","content":5}]}`},
		{"/v1/chat/completions", `{"messages":"hi"}`},
		{"/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}],"n":0}`},
		{"/v1/completions", `{"prompt":{}}`},
		{"/v1/completions", `{"prompt":"x","logprobs":true}`},
		{"/v1/embeddings", `{"input":[]}`},
		{"/v1/rerank", `{"query":"q"}`},
		{"/v1/responses", `{"input":3}`},
	} {
		code, hdr, b := h.post(c.path, c.body)
		if code != http.StatusBadRequest || hdr.Get("Content-Type") != "application/json" {
			t.Errorf("%s %s: %d %s", c.path, c.body, code, b)
			continue
		}
		m := decodeObj(t, b)
		if m["object"] != "error" || m["type"] != "BadRequestError" || num(t, m, "code") != 400 || m["message"] == "" {
			t.Errorf("%s %s: error shape %s", c.path, c.body, b)
		}
	}
	// No Content-Type at all is fine, as with SGLang's FastAPI.
	req, _ := http.NewRequest(http.MethodPost, h.s.URL()+"/generate", strings.NewReader(`{"text":"a"}`))
	req.Header.Del("Content-Type")
	resp, err := h.client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Errorf("no content type: %d", resp.StatusCode)
	}
	if st := h.s.Stats(); st.Errors != 23 || st.Completed != 1 || st.InFlight != 0 {
		t.Errorf("stats %+v", st)
	}
}

func TestAPIKey(t *testing.T) {
	h := start(t, Config{APIKey: "sekrit"})
	for _, c := range []struct {
		auth string
		want int
	}{{"", 401}, {"Bearer nope", 401}, {"sekrit", 401}, {"Bearer sekrit", 200}} {
		code, _, b := h.post("/generate", `{"text":"a"}`, "Authorization", c.auth)
		if code != c.want {
			t.Errorf("%q: %d %s", c.auth, code, b)
		}
	}
	if code, _ := h.get("/health"); code != 200 {
		t.Errorf("/health must stay public: %d", code)
	}
	if code, _ := h.get("/get_server_info"); code != 401 {
		t.Errorf("/get_server_info: %d", code)
	}
	any := start(t, Config{RequireAPIKey: true})
	if code, _, _ := any.post("/generate", `{"text":"a"}`, "Authorization", "Bearer whatever"); code != 200 {
		t.Errorf("require-api-key with any bearer: %d", code)
	}
	if code, _, _ := any.post("/generate", `{"text":"a"}`); code != 401 {
		t.Errorf("require-api-key without bearer: %d", code)
	}
}
