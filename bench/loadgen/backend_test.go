package loadgen

import (
	"encoding/json"
	"testing"
)

func TestBodies(t *testing.T) {
	p := Prompt{Text: "hi there", OutputLen: 7}
	decode := func(b Backend, o BodyOptions) map[string]any {
		raw, err := b.Body(p, o)
		if err != nil {
			t.Fatal(err)
		}
		var m map[string]any
		if err := json.Unmarshal(raw, &m); err != nil {
			t.Fatal(err)
		}
		return m
	}
	sg := decode(SGLang, BodyOptions{Stream: true, IgnoreEOS: true, ExtraBody: map[string]any{"rid": "r1"}})
	sp, _ := sg["sampling_params"].(map[string]any)
	if sg["text"] != "hi there" || sg["stream"] != true || sg["rid"] != "r1" || sg["model"] != nil ||
		sp["max_new_tokens"] != 7.0 || sp["ignore_eos"] != true || sp["temperature"] != 0.0 {
		t.Errorf("sglang body %v", sg)
	}
	chat := decode(OpenAIChat, BodyOptions{Model: "m", Stream: true, IgnoreEOS: true})
	msgs, _ := chat["messages"].([]any)
	so, _ := chat["stream_options"].(map[string]any)
	if chat["model"] != "m" || chat["max_tokens"] != 7.0 || len(msgs) != 1 || so["include_usage"] != true || chat["ignore_eos"] != true {
		t.Errorf("chat body %v", chat)
	}
	cmpl := decode(OpenAI, BodyOptions{Model: "m"})
	if cmpl["prompt"] != "hi there" || cmpl["stream"] != false || cmpl["stream_options"] != nil || cmpl["ignore_eos"] != nil {
		t.Errorf("completions body %v", cmpl)
	}
	for s, want := range map[string]string{"openai-chat": "/v1/chat/completions", "openai": "/v1/completions", "sglang": "/generate"} {
		if b, err := ParseBackend(s); err != nil || b.Path() != want {
			t.Errorf("%s: %v %v", s, b.Path(), err)
		}
	}
	if _, err := ParseBackend("vllm"); err == nil {
		t.Error("unknown backend accepted")
	}
}
