package mockworker

import (
	"strings"
	"testing"
)

func TestGenerateStream(t *testing.T) {
	h := start(t, Config{Tokens: 3})
	code, hdr, b := h.post("/generate", `{"text":"a b","stream":true,"return_logprob":true}`)
	if code != 200 || hdr.Get("Content-Type") != "text/event-stream" || hdr.Get("X-Worker-Id") != h.s.WorkerID() {
		t.Fatalf("%d %v", code, hdr)
	}
	evs := parseSSE(t, b)
	if len(evs) != 3 {
		t.Fatalf("want 3 chunks, got %d: %s", len(evs), b)
	}
	final := h.postJSON("/generate", `{"text":"a b"}`)
	for k, ev := range evs {
		// Cumulative text and counts, finish_reason only on the last chunk.
		if n := num(t, ev, "meta_info", "completion_tokens"); n != k+1 || len(strings.Fields(ev["text"].(string))) != k+1 {
			t.Errorf("chunk %d: %v", k, ev)
		}
		if fr := path(t, ev, "meta_info", "finish_reason"); (fr == nil) != (k < 2) {
			t.Errorf("chunk %d finish_reason %v", k, fr)
		}
		if arrLen(t, ev, "meta_info", "output_token_logprobs") != k+1 || arrLen(t, ev, "meta_info", "input_token_logprobs") != 2 {
			t.Errorf("chunk %d logprobs %v", k, ev["meta_info"])
		}
	}
	if evs[2]["text"] != final["text"] {
		t.Errorf("stream text %q != non-stream %q", evs[2]["text"], final["text"])
	}

	// A batch stream interleaves elements, tagged with "index".
	_, _, b = h.post("/generate", `{"input_ids":[[1],[2]],"stream":true,"sampling_params":[{"max_new_tokens":2},{"max_new_tokens":1}]}`)
	evs = parseSSE(t, b)
	var idx []int
	for _, ev := range evs {
		idx = append(idx, num(t, ev, "index"))
	}
	if len(idx) != 3 || idx[0] != 0 || idx[1] != 1 || idx[2] != 0 {
		t.Errorf("batch stream indexes %v", idx)
	}
	// Zero tokens still produce one final chunk.
	_, _, b = h.post("/generate", `{"text":"x","stream":true,"sampling_params":{"max_new_tokens":0}}`)
	if evs := parseSSE(t, b); len(evs) != 1 || num(t, evs[0], "meta_info", "completion_tokens") != 0 || path(t, evs[0], "meta_info", "finish_reason") == nil {
		t.Errorf("zero tokens: %s", b)
	}
}

func TestChatStream(t *testing.T) {
	h := start(t, Config{Tokens: 2})
	code, hdr, b := h.post("/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"logprobs":true,"stream_options":{"include_usage":true}}`)
	if code != 200 || hdr.Get("Content-Type") != "text/event-stream" {
		t.Fatalf("%d %s", code, b)
	}
	evs := parseSSE(t, b)
	// role, 2 tokens, finish, usage
	if len(evs) != 5 {
		t.Fatalf("%d chunks: %s", len(evs), b)
	}
	var text string
	for i, ev := range evs {
		if ev["object"] != "chat.completion.chunk" || ev["id"] != evs[0]["id"] || ev["model"] != "m" {
			t.Errorf("chunk %d envelope %v", i, ev)
		}
		if i < 4 {
			if c, ok := path(t, ev, "choices", 0, "delta").(map[string]any)["content"]; ok {
				text += c.(string)
			}
		}
	}
	if path(t, evs[0], "choices", 0, "delta", "role") != "assistant" {
		t.Errorf("first chunk %v", evs[0])
	}
	if arrLen(t, evs[1], "choices", 0, "logprobs", "content") != 1 {
		t.Errorf("token chunk logprobs %v", evs[1])
	}
	if path(t, evs[3], "choices", 0, "finish_reason") != "length" || path(t, evs[2], "choices", 0, "finish_reason") != nil {
		t.Errorf("finish_reason: %v / %v", evs[2], evs[3])
	}
	if arrLen(t, evs[4], "choices") != 0 || num(t, evs[4], "usage", "completion_tokens") != 2 || num(t, evs[4], "usage", "prompt_tokens") != 1 {
		t.Errorf("usage chunk %v", evs[4])
	}
	full := h.postJSON("/v1/chat/completions", `{"messages":[{"role":"user","content":"hi"}]}`)
	if text != path(t, full, "choices", 0, "message", "content") {
		t.Errorf("stream text %q vs %v", text, full)
	}
	// Without include_usage no chunk carries usage.
	_, _, b = h.post("/v1/chat/completions", `{"messages":[{"role":"user","content":"hi"}],"stream":true}`)
	for _, ev := range parseSSE(t, b) {
		if _, ok := ev["usage"]; ok {
			t.Errorf("unexpected usage %v", ev)
		}
	}
}

func TestCompletionStream(t *testing.T) {
	h := start(t, Config{Tokens: 2})
	_, _, b := h.post("/v1/completions", `{"prompt":"p q","stream":true,"logprobs":0,"stream_options":{"include_usage":true}}`)
	evs := parseSSE(t, b)
	if len(evs) != 4 { // 2 tokens, finish, usage
		t.Fatalf("%s", b)
	}
	if evs[0]["object"] != "text_completion" || arrLen(t, evs[0], "choices", 0, "logprobs", "tokens") != 1 {
		t.Errorf("%v", evs[0])
	}
	if path(t, evs[2], "choices", 0, "finish_reason") != "length" || num(t, evs[3], "usage", "total_tokens") != 4 {
		t.Errorf("%v %v", evs[2], evs[3])
	}
	full := h.postJSON("/v1/completions", `{"prompt":"p q"}`)
	if got := evs[0]["choices"].([]any)[0].(map[string]any)["text"].(string) + evs[1]["choices"].([]any)[0].(map[string]any)["text"].(string); got != path(t, full, "choices", 0, "text") {
		t.Errorf("stream text %q vs %v", got, full)
	}
}
