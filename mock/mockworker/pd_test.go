package mockworker

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"
)

const boot = `"bootstrap_host":"10.0.0.1","bootstrap_port":8998,"bootstrap_room":9223372036854775807`

func TestPDRolesRequireBootstrap(t *testing.T) {
	for _, role := range []Role{RolePrefill, RoleDecode} {
		h := start(t, Config{Role: role})
		for _, c := range []struct{ path, body string }{
			{"/generate", `{"text":"x"}`},
			{"/generate", `{"text":"x","bootstrap_host":"h"}`},
			{"/generate", `{"text":"x","bootstrap_room":1,"bootstrap_host":null}`},
			{"/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}]}`},
			{"/v1/completions", `{"prompt":"x"}`},
		} {
			code, _, b := h.post(c.path, c.body)
			if code != 400 || !strings.Contains(string(b), "bootstrap") {
				t.Errorf("%s %s %s: %d %s", role, c.path, c.body, code, b)
			}
		}
		for _, c := range []struct{ path, body string }{
			{"/generate", `{"text":"x",` + boot + `}`},
			{"/generate", `{"text":"x","bootstrap_host":"h","bootstrap_port":null,"bootstrap_room":0}`},
			{"/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}],` + boot + `}`},
			{"/v1/completions", `{"prompt":"x",` + boot + `}`},
			{"/v1/rerank", `{"query":"q","documents":["d"]}`}, // not a generation route
		} {
			if code, _, b := h.post(c.path, c.body); code != 200 {
				t.Errorf("%s %s %s: %d %s", role, c.path, c.body, code, b)
			}
		}
	}
	// Regular role ignores missing bootstrap fields.
	if code, _, _ := start(t, Config{}).post("/generate", `{"text":"x"}`); code != 200 {
		t.Errorf("regular: %d", code)
	}
}

func TestRecordsBootstrapRaw(t *testing.T) {
	h := start(t, Config{Role: RoleDecode})
	body := `{"input_ids":[[1],[2]],"bootstrap_host":["h","h"],"bootstrap_port":[null, 7],"bootstrap_room":[1,18446744073709551615]}`
	code, _, b := h.post("/generate", body, "X-Request-Id", "abc", "Authorization", "Bearer k")
	if code != 200 {
		t.Fatalf("%d %s", code, b)
	}
	h.post("/generate", `{"text":"x",`+boot+`}`)
	_, raw := h.get("/_mock/requests")
	var recs []map[string]any
	if err := json.Unmarshal(raw, &recs); err != nil || len(recs) != 2 {
		t.Fatalf("%v %s", err, raw)
	}
	r := recs[0]
	if r["path"] != "/generate" || r["method"] != "POST" || r["body"] != body || r["finished"] != "ok" {
		t.Errorf("record %v", r)
	}
	if path(t, r, "headers", "x-request-id") != "abc" || path(t, r, "headers", "authorization") != "Bearer k" {
		t.Errorf("headers %v", r["headers"])
	}
	// Raw JSON values as received: the null stays null, the u64 exact (the
	// HTTP form is compacted, the Go form is byte for byte).
	var exact struct {
		Port json.RawMessage `json:"bootstrap_port"`
		Room json.RawMessage `json:"bootstrap_room"`
	}
	if err := json.Unmarshal(mustArr(t, raw)[0], &exact); err != nil || string(exact.Port) != "[null,7]" || string(exact.Room) != "[1,18446744073709551615]" {
		t.Errorf("raw bootstrap %s %s", exact.Port, exact.Room)
	}
	if p := h.s.Requests()[0].BootstrapPort; string(p) != "[null, 7]" {
		t.Errorf("Go record port %s", p)
	}
	if num(t, r, "started_unix_nano") == 0 || num(t, r, "finished_unix_nano") < num(t, r, "started_unix_nano") {
		t.Errorf("times %v", r)
	}
	if recs[1]["bootstrap_host"] != "10.0.0.1" || num(t, recs[1], "bootstrap_port") != 8998 {
		t.Errorf("second %v", recs[1])
	}
	_, st := h.get("/_mock/stats")
	if m := decodeObj(t, st); num(t, m, "requests") != 2 || num(t, m, "completed") != 2 || num(t, m, "in_flight") != 0 || num(t, m, "client_gone") != 0 || num(t, m, "errors") != 0 {
		t.Errorf("stats %s", st)
	}
	if code, _, _ := h.post("/_mock/reset", ""); code != http.StatusNoContent {
		t.Errorf("reset %d", code)
	}
	if _, raw := h.get("/_mock/requests"); string(raw) != "[]" {
		t.Errorf("after reset %s", raw)
	}
	if st := h.s.Stats(); !reflect.DeepEqual(st, Stats{RankRequests: []int64{0}}) {
		t.Errorf("stats after reset %+v", st)
	}
}

func mustArr(t *testing.T, b []byte) []json.RawMessage {
	t.Helper()
	var a []json.RawMessage
	if err := json.Unmarshal(b, &a); err != nil {
		t.Fatal(err)
	}
	return a
}

func TestRecordLimit(t *testing.T) {
	h := start(t, Config{RecordLimit: 3})
	for i := range 5 {
		h.post("/generate", fmt.Sprintf(`{"text":"%d"}`, i))
	}
	r := h.s.Requests()
	if len(r) != 3 || r[0].Body != `{"text":"2"}` || r[2].Body != `{"text":"4"}` {
		t.Errorf("ring %+v", r)
	}
	n := start(t, Config{RecordLimit: -1})
	n.post("/generate", `{"text":"x"}`)
	if len(n.s.Requests()) != 0 || n.s.Stats().Completed != 1 {
		t.Error("negative limit should record nothing but still count")
	}
}

func TestPrefillRole(t *testing.T) {
	h := start(t, Config{Role: RolePrefill, Tokens: 8})
	// The whole prompt's input logprobs; one output token.
	m := h.postJSON("/generate", `{"text":"one two three four five","return_logprob":true,`+boot+`}`)
	if num(t, m, "meta_info", "completion_tokens") != 1 || arrLen(t, m, "meta_info", "input_token_logprobs") != 5 || arrLen(t, m, "meta_info", "output_token_logprobs") != 1 {
		t.Errorf("prefill generate %v", m)
	}
	m = h.postJSON("/generate", `{"input_ids":[5,6,7],"return_logprob":true,`+boot+`}`)
	if arrLen(t, m, "meta_info", "input_token_logprobs") != 3 || num(t, m, "meta_info", "input_token_logprobs", 2, 1) != 7 {
		t.Errorf("input_ids logprobs %v", m)
	}
	// Streaming: exactly one data chunk, then [DONE].
	for _, c := range []struct{ path, body string }{
		{"/generate", `{"text":"a b","stream":true,` + boot + `}`},
		{"/v1/chat/completions", `{"messages":[{"role":"user","content":"a b"}],"stream":true,"stream_options":{"include_usage":true},` + boot + `}`},
		{"/v1/completions", `{"prompt":"a b","stream":true,` + boot + `}`},
	} {
		_, _, b := h.post(c.path, c.body)
		evs := parseSSE(t, b)
		if len(evs) != 1 {
			t.Errorf("%s: %d chunks: %s", c.path, len(evs), b)
		}
	}
	m = h.postJSON("/v1/chat/completions", `{"messages":[{"role":"user","content":"a"}],`+boot+`}`)
	if num(t, m, "usage", "completion_tokens") != 1 {
		t.Errorf("prefill chat %v", m)
	}
}

func TestDecodeRoleShortInputLogprobs(t *testing.T) {
	h := start(t, Config{Role: RoleDecode, Tokens: 4})
	m := h.postJSON("/generate", `{"text":"one two three","return_logprob":true,`+boot+`}`)
	lp := path(t, m, "meta_info", "input_token_logprobs").([]any)
	if len(lp) != 1 || num(t, m, "meta_info", "completion_tokens") != 4 || arrLen(t, m, "meta_info", "output_token_logprobs") != 4 {
		t.Fatalf("decode %v", m)
	}
	// It is the prompt's last token, as the prefill side reports it.
	p := start(t, Config{Role: RolePrefill})
	pm := p.postJSON("/generate", `{"text":"one two three","return_logprob":true,`+boot+`}`)
	last := path(t, pm, "meta_info", "input_token_logprobs", 2).([]any)
	if lp[0].([]any)[1] != last[1] || lp[0].([]any)[0] != last[0] {
		t.Errorf("decode %v vs prefill last %v", lp, last)
	}
	// And the decode output starts with the prefill's single token.
	if !strings.HasPrefix(m["text"].(string), pm["text"].(string)) {
		t.Errorf("decode %q, prefill %q", m["text"], pm["text"])
	}
}

// fakeKV records calls and answers per room.
type fakeKV struct {
	mu    sync.Mutex
	calls []string
	fail  error
	delay time.Duration
}

func (f *fakeKV) do(ctx context.Context, side string, r KVRequest) (*KVResult, error) {
	f.mu.Lock()
	f.calls = append(f.calls, fmt.Sprintf("%s room=%d host=%s port=%d prompt=%s tokens=%d", side, r.Room, r.BootstrapHost, r.BootstrapPort, r.Prompt, r.PromptTokens))
	f.mu.Unlock()
	if !sleep(ctx, f.delay) {
		return nil, ctx.Err()
	}
	if f.fail != nil {
		return nil, f.fail
	}
	return &KVResult{Bytes: int64(r.PromptTokens) * 1024, Pages: int64(r.Room), Transport: "fake", ChecksumOK: true, TransferMS: 1.5}, nil
}

func (f *fakeKV) Calls() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.calls...)
}

func (f *fakeKV) Prefill(ctx context.Context, r KVRequest) (*KVResult, error) {
	return f.do(ctx, "prefill", r)
}

func (f *fakeKV) Decode(ctx context.Context, r KVRequest) (*KVResult, error) {
	return f.do(ctx, "decode", r)
}

var _ KVTransfer = (*fakeKV)(nil)

func TestKVSeam(t *testing.T) {
	kv := &fakeKV{}
	h := start(t, Config{Role: RoleDecode, KV: kv, Tokens: 2, BootstrapPort: 9000})
	m := h.postJSON("/generate", `{"text":"a b","bootstrap_host":"ph","bootstrap_port":null,"bootstrap_room":7}`)
	if k := path(t, m, "meta_info", "kv_transfer"); num(t, k, "bytes") != 2048 || num(t, k, "pages") != 7 || path(t, k, "transport") != "fake" || path(t, k, "checksum_ok") != true || path(t, k, "transfer_ms") != 1.5 {
		t.Errorf("kv_transfer %v", k)
	}
	if kv.Calls()[0] != "decode room=7 host=ph port=9000 prompt=a b tokens=2" {
		t.Errorf("call %q", kv.Calls()[0])
	}
	// OpenAI routes: top-level, on the last chunk only when streaming.
	c := h.postJSON("/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}],`+boot+`}`)
	if num(t, c, "kv_transfer", "bytes") != 1024 {
		t.Errorf("chat kv %v", c)
	}
	for _, body := range []string{
		`{"messages":[{"role":"user","content":"x"}],"stream":true,` + boot + `}`,
		`{"messages":[{"role":"user","content":"x"}],"stream":true,"stream_options":{"include_usage":true},` + boot + `}`,
	} {
		_, _, b := h.post("/v1/chat/completions", body)
		evs := parseSSE(t, b)
		for i, ev := range evs {
			if _, ok := ev["kv_transfer"]; ok != (i == len(evs)-1) {
				t.Errorf("chunk %d/%d kv_transfer presence %v", i, len(evs), ok)
			}
		}
	}
	_, _, b := h.post("/generate", `{"text":"x","stream":true,`+boot+`}`)
	evs := parseSSE(t, b)
	if _, ok := evs[len(evs)-1]["meta_info"].(map[string]any)["kv_transfer"]; !ok {
		t.Errorf("generate stream: no kv_transfer in the last chunk: %s", b)
	}
	// Arrays: one transfer per room; an array in the OpenAI body.
	before := len(kv.Calls())
	cm := h.postJSON("/v1/completions", `{"prompt":["p","q r"],"bootstrap_host":["h","h"],"bootstrap_port":[1,2],"bootstrap_room":[3,4]}`)
	if arrLen(t, cm, "kv_transfer") != 2 || num(t, cm, "kv_transfer", 1, "pages") != 4 || num(t, cm, "kv_transfer", 1, "bytes") != 2048 || len(kv.Calls()) != before+2 {
		t.Errorf("completions kv %v calls %v", cm["kv_transfer"], kv.Calls())
	}
}

func TestKVBatchGenerate(t *testing.T) {
	h := start(t, Config{Role: RolePrefill, KV: &fakeKV{}})
	code, _, b := h.post("/generate", `{"input_ids":[[1],[2,3]],"bootstrap_host":"h","bootstrap_room":[5,6]}`)
	var arr []map[string]any
	if err := json.Unmarshal(b, &arr); code != 200 || err != nil {
		t.Fatalf("%d %s", code, b)
	}
	if num(t, arr[0], "meta_info", "kv_transfer", "pages") != 5 || num(t, arr[1], "meta_info", "kv_transfer", "pages") != 6 || num(t, arr[1], "meta_info", "kv_transfer", "bytes") != 2048 {
		t.Errorf("batch kv %s", b)
	}
}

func TestKVErrorIs500(t *testing.T) {
	kv := &fakeKV{fail: errors.New("checksum mismatch")}
	h := start(t, Config{Role: RoleDecode, KV: kv})
	for _, body := range []string{`{"text":"x",` + boot + `}`, `{"text":"x","stream":true,` + boot + `}`} {
		code, hdr, b := h.post("/generate", body)
		if code != 500 || hdr.Get("Content-Type") != "application/json" || !strings.Contains(string(b), "checksum mismatch") {
			t.Errorf("%d %s", code, b)
		}
	}
	if st := h.s.Stats(); st.Errors != 2 {
		t.Errorf("stats %+v", st)
	}
}

func TestKVNilResultAndRegularRole(t *testing.T) {
	h := start(t, Config{Role: RoleDecode, KV: nilKV{}})
	if m := h.postJSON("/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}],`+boot+`}`); m["kv_transfer"] != nil {
		t.Errorf("nil result reported: %v", m)
	}
	kv := &fakeKV{}
	r := start(t, Config{KV: kv})
	r.postJSON("/generate", `{"text":"x",`+boot+`}`)
	if len(kv.Calls()) != 0 {
		t.Error("regular role must not transfer KV")
	}
}

type nilKV struct{}

func (nilKV) Prefill(context.Context, KVRequest) (*KVResult, error) { return nil, nil }
func (nilKV) Decode(context.Context, KVRequest) (*KVResult, error)  { return nil, nil }

func TestDecodeWaitsForKV(t *testing.T) {
	const d = 120 * time.Millisecond
	kv := &fakeKV{delay: d}
	h := start(t, Config{Role: RoleDecode, KV: kv, Tokens: 2})
	t0 := time.Now()
	resp := h.do(http.MethodPost, "/generate", `{"text":"x","stream":true,`+boot+`}`)
	defer resp.Body.Close()
	if el := time.Since(t0); el < d {
		t.Errorf("stream started after %v, before the KV result (%v)", el, d)
	}
	for range readEvents(resp.Body) {
	}
	// A client leaving while decode waits for KV cancels the transfer.
	ctx, cancel := context.WithTimeout(context.Background(), d/3)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, h.s.URL()+"/generate", strings.NewReader(`{"text":"x",`+boot+`}`))
	if _, err := h.client.Do(req); err == nil {
		t.Fatal("expected timeout")
	}
	waitFor(t, "client_gone", func() bool { return h.s.Stats().ClientGone == 1 })
}
