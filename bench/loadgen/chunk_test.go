package loadgen

import (
	"bytes"
	"encoding/json"
	"io"
	"strings"
	"testing"
	"time"
)

func TestParseChunk(t *testing.T) {
	cases := []struct {
		in   string
		want chunk
		bad  bool
	}{
		{`{"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}],"usage":null}`, chunk{content: true, tokens: -1}, false},
		{`{"choices":[{"delta":{"role":"assistant","content":""}}]}`, chunk{tokens: -1}, false},
		{`{"choices":[{"delta":{"content":null,"reasoning_content":"hmm"}}]}`, chunk{content: true, tokens: -1}, false},
		{`{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":128,"total_tokens":133}}`, chunk{tokens: 128}, false},
		{`{"choices":[{"text":"x","logprobs":{"a":[1,2,{"b":[]}]}}]}`, chunk{content: true, tokens: -1}, false},
		{`{"choices":[{"text":""},{"text":"second choice is ignored"}]}`, chunk{tokens: -1}, false},
		{`{"choices":[{"message":{"role":"assistant","content":"whole"}}],"usage":{"completion_tokens":3}}`, chunk{content: true, tokens: 3}, false},
		{`{"text":"a b","meta_info":{"id":"1","prompt_tokens":4,"completion_tokens":2,"e2e_latency":1.5e-1}}`, chunk{content: true, tokens: 2}, false},
		{` { "text" : "\"q\"" , "meta_info" : { "completion_tokens" : 7.0 } } `, chunk{content: true, tokens: 7}, false},
		{`{"error":{"message":"bad","code":400}}`, chunk{err: true, tokens: -1}, false},
		{`{"error":null,"choices":[{"delta":{"content":"ok"}}]}`, chunk{content: true, tokens: -1}, false},
		{`{}`, chunk{tokens: -1}, false},
		{`{"choices":[{"delta":{"content":"x"}}]`, chunk{tokens: -1}, true},
		{`{'error': 'python'}`, chunk{tokens: -1}, true},
		{`{"a":1} trailing`, chunk{tokens: -1}, true},
		{`[1,2]`, chunk{tokens: -1}, true},
		{`{"usage":{"completion_tokens":"many"},"choices":{"text":"not a list"},"text":7}`, chunk{tokens: -1}, false},
		{`{"choices":[{"delta":"x","text":["y"]}],"meta_info":[1]}`, chunk{tokens: -1}, false},
		{`{"a":tru}`, chunk{tokens: -1}, true},
		{``, chunk{tokens: -1}, true},
	}
	for _, c := range cases {
		got, err := parseChunk([]byte(c.in))
		if got != c.want || (err != nil) != c.bad {
			t.Errorf("parseChunk(%s) = %+v, %v; want %+v, bad=%v", c.in, got, err, c.want, c.bad)
		}
	}
}

func TestParseChunkDoesNotAllocate(t *testing.T) {
	b := []byte(`{"id":"c","choices":[{"index":0,"delta":{"content":"tok"},"logprobs":null}],"usage":{"completion_tokens":9}}`)
	if n := testing.AllocsPerRun(100, func() { _, _ = parseChunk(b) }); n != 0 {
		t.Errorf("parseChunk allocates %v times per chunk", n)
	}
}

// FuzzParseChunk checks that the scanner never panics, accepts every valid JSON object, and
// never misses content that encoding/json sees.
func FuzzParseChunk(f *testing.F) {
	for _, s := range []string{
		`{"choices":[{"delta":{"content":"hi"}}],"usage":null}`,
		`{"choices":[],"usage":{"completion_tokens":12}}`,
		`{"text":"a","meta_info":{"completion_tokens":1}}`,
		`{"error":{"message":"x"}}`,
		`{"choices":[{"text":"\u00e9\"","logprobs":{"tokens":["a"],"top":[{"a":-0.5e3}]}}]}`,
		`[[[[[[[[[[]]]]]]]]]]`, `{"a":`, `"`, `{"a":"\`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		c, err := parseChunk(b)
		var m map[string]any
		if json.Unmarshal(b, &m) != nil || m == nil {
			return
		}
		if err != nil && depth(b) < 512 { // splice's nesting bound
			t.Fatalf("valid object %q rejected: %v", b, err)
		}
		if bytes.IndexByte(b, '\\') < 0 && err == nil && hasContent(m) && !c.content {
			t.Fatalf("missed content in %q", b)
		}
	})
}

// FuzzReadSSE feeds arbitrary bytes through the SSE reader: it must not panic or hang.
func FuzzReadSSE(f *testing.F) {
	f.Add([]byte("data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\ndata: [DONE]\n\n"))
	f.Add([]byte("data:{\"text\":\"a\",\"meta_info\":{\"completion_tokens\":3}}\r\n\r\n: c\nevent: e\ndata: {"))
	f.Add([]byte(strings.Repeat("data: x", 5000)))
	f.Fuzz(func(t *testing.T, b []byte) {
		for _, sg := range []bool{false, true} {
			var res Result
			st := stream{s: &Sender{now: func() time.Time { return time.Time{} }, sglang: sg}, res: &res, tokens: -1, limit: 100}
			_ = st.readSSE(io.NopCloser(bytes.NewReader(b)))
			if st.chunks > 0 && (len(res.ITL) < st.chunks-1 || len(res.ITL) > max(st.limit, st.chunks)) {
				t.Fatalf("%d content chunks but %d ITL samples", st.chunks, len(res.ITL))
			}
		}
	})
}

func depth(b []byte) int {
	d, m := 0, 0
	for _, c := range b {
		switch c {
		case '{', '[':
			d++
			m = max(m, d)
		case '}', ']':
			d--
		}
	}
	return m
}

// hasContent reports, from a generic decode, whether any field we treat as content is non-empty.
func hasContent(m map[string]any) bool {
	nonEmpty := func(v any) bool { s, ok := v.(string); return ok && s != "" }
	if nonEmpty(m["text"]) {
		return true
	}
	choices, _ := m["choices"].([]any)
	if len(choices) == 0 {
		return false
	}
	c0, _ := choices[0].(map[string]any)
	if nonEmpty(c0["text"]) {
		return true
	}
	for _, k := range []string{"delta", "message"} {
		if d, ok := c0[k].(map[string]any); ok && (nonEmpty(d["content"]) || nonEmpty(d["reasoning_content"])) {
			return true
		}
	}
	return false
}
