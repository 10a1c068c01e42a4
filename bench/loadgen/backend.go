package loadgen

import (
	"encoding/json"
	"fmt"
	"maps"
)

// Backend is the API dialect requests are sent in.
type Backend string

const (
	OpenAIChat Backend = "openai-chat" // POST /v1/chat/completions
	OpenAI     Backend = "openai"      // POST /v1/completions
	SGLang     Backend = "sglang"      // POST /generate
)

// ParseBackend checks a --backend value.
func ParseBackend(s string) (Backend, error) {
	switch b := Backend(s); b {
	case OpenAIChat, OpenAI, SGLang:
		return b, nil
	}
	return "", fmt.Errorf("unknown backend %q (want openai-chat, openai or sglang)", s)
}

// Path is the endpoint the backend posts to.
func (b Backend) Path() string {
	switch b {
	case OpenAIChat:
		return "/v1/chat/completions"
	case OpenAI:
		return "/v1/completions"
	}
	return "/generate"
}

// BodyOptions are the request-body settings shared by every prompt of a run.
type BodyOptions struct {
	Model     string
	Stream    bool
	IgnoreEOS bool
	ExtraBody map[string]any // merged over the generated body, as --extra-request-body
}

// Body renders the JSON body for one prompt the way bench_serving builds it: greedy sampling,
// max_tokens (max_new_tokens for /generate) set to the prompt's output length, ignore_eos so the
// server produces exactly that many tokens, and usage in the final OpenAI stream chunk.
func (b Backend) Body(p Prompt, o BodyOptions) ([]byte, error) {
	m := map[string]any{"stream": o.Stream}
	switch b {
	case SGLang:
		m["text"] = p.Text
		m["sampling_params"] = map[string]any{
			"temperature": 0, "max_new_tokens": p.OutputLen, "ignore_eos": o.IgnoreEOS,
		}
	default:
		if b == OpenAIChat {
			m["messages"] = []map[string]string{{"role": "user", "content": p.Text}}
		} else {
			m["prompt"] = p.Text
		}
		m["max_tokens"] = p.OutputLen
		m["temperature"] = 0
		if o.IgnoreEOS {
			m["ignore_eos"] = true
		}
		if o.Stream {
			m["stream_options"] = map[string]bool{"include_usage": true}
		}
	}
	if o.Model != "" {
		m["model"] = o.Model
	}
	maps.Copy(m, o.ExtraBody)
	return json.Marshal(m)
}
