package router

import (
	"bytes"
	"encoding/json"
	"regexp"
	"strings"
	"testing"
	"testing/iotest"

	"github.com/pdrouter/pdrouter/router/splice"
)

func TestVLLMHeaderReplacesOnlyTheRequestID(t *testing.T) {
	const id = `X-Request-Id: ___prefill_addr_10\.0\.0\.1:8100___decode_addr_\[::1\]:8200_[0-9a-f]{32}\r\n$`
	for _, c := range []struct{ in, keep string }{
		{"X-Request-Id: client\r\n", ""},
		{"Authorization: Bearer k\r\nX-Request-Id-Tag: X-Request-Id: x\r\nX-Request-Id: client\r\n",
			"Authorization: Bearer k\r\nX-Request-Id-Tag: X-Request-Id: x\r\n"},
		{"", ""},
		{"Traceparent: 00-1\r\n", "Traceparent: 00-1\r\n"},
	} {
		got := string(appendVLLMHeader(nil, []byte(c.in), "10.0.0.1:8100", "[::1]:8200"))
		if !regexp.MustCompile("^" + regexp.QuoteMeta(c.keep) + id).MatchString(got) {
			t.Errorf("%q: got %q, want %q and the pair's id", c.in, got, c.keep)
		}
		if again := string(appendVLLMHeader(nil, []byte(c.in), "10.0.0.1:8100", "[::1]:8200")); again == got {
			t.Error("two attempts share a request id")
		}
	}
}

// checkPrefillBody asserts what a prefill is sent: the client's members,
// those a prefill must not run with rewritten, valid JSON throughout.
func checkPrefillBody(t *testing.T, client []byte) {
	var info splice.Info
	if splice.Inspect(client, &info) != nil {
		return
	}
	if bytes.Contains(client, []byte(`\u`)) {
		return // a key spelled with escapes is not one the router rewrites, by design (splice.Info)
	}
	var in map[string]json.RawMessage
	if json.Unmarshal(client, &in) != nil {
		return // a body with duplicate or escaped keys: Inspect accepts more than this check models
	}
	var at vllmSpans
	splice.FindFields(client, vllmFields[:], at[:])
	var b splice.Body
	vllmPrefillBody(&b, client, &at)
	out := b.AppendTo(nil)
	var got map[string]json.RawMessage
	if err := json.Unmarshal(out, &got); err != nil {
		t.Fatalf("prefill body %s from %s: %v", out, client, err)
	}
	want := map[string]string{"max_tokens": "1", "stream": "false", "kv_transfer_params": string(vllmPrefillParams)}
	for k, v := range map[string]string{"max_completion_tokens": "1", "stream_options": "null", "min_tokens": "0", "min_completion_tokens": "0"} {
		if _, ok := in[k]; ok {
			want[k] = v
		}
	}
	for k, v := range in {
		if _, ok := want[k]; !ok {
			want[k] = string(v)
		}
	}
	if len(got) != len(want) {
		t.Fatalf("prefill body %s from %s: members %d, want %d", out, client, len(got), len(want))
	}
	for k, v := range want {
		if string(got[k]) != v {
			t.Fatalf("prefill body %s from %s: %s = %s, want %s", out, client, k, got[k], v)
		}
	}
}

func TestVLLMPrefillBody(t *testing.T) {
	for _, body := range []string{`{}`, ` { } `, `{"prompt":"a"}`,
		`{"stream":true,"stream_options":{"include_usage":true},"max_tokens":50,"max_completion_tokens":50,"min_tokens":9,"min_completion_tokens":9,"kv_transfer_params":{"x":1}}`,
		`{"messages":[{"role":"user","content":"{\"stream\":true}"}],"n":2}`} {
		checkPrefillBody(t, []byte(body))
	}
}

func FuzzVLLMPrefillBody(f *testing.F) {
	for _, s := range []string{`{}`, `{"stream":true,"max_tokens":3}`, `{"a":[{"stream":1}],"stream_options":null}`} {
		f.Add([]byte(s))
	}
	f.Fuzz(checkPrefillBody)
}

func TestReadUpTo(t *testing.T) {
	long := strings.Repeat("x", 100)
	for _, c := range []struct {
		capacity, limit int
		err             bool
	}{{8, 100, false}, {200, 100, false}, {8, 99, true}, {200, 99, true}} {
		got, err := readUpTo(make([]byte, 0, c.capacity), iotest.OneByteReader(strings.NewReader(long)), c.limit)
		if (err != nil) != c.err || !c.err && string(got) != long {
			t.Errorf("cap %d limit %d: %d bytes, %v", c.capacity, c.limit, len(got), err)
		}
	}
}
