package splice

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"
)

func TestFindFields(t *testing.T) {
	keys := []string{"stream", "max_tokens", "kv_transfer_params", "absent"}
	body := []byte(` { "messages":[{"content":"stream"}], "max_tokens" : 7,"stream":true,` +
		`"nested":{"max_tokens":1},"kv_transfer_params":{"a":[1,{"b":null}]},"max_tokens":9 }`)
	out := make([]Span, len(keys))
	if err := FindFields(body, keys, out); err != nil {
		t.Fatal(err)
	}
	want := []string{"true", "9", `{"a":[1,{"b":null}]}`, ""}
	for k, w := range want {
		got := ""
		if out[k].OK() {
			got = string(body[out[k].Start:out[k].End])
		}
		if got != w {
			t.Errorf("%s = %q, want %q", keys[k], got, w)
		}
	}
}

func TestFindFieldsBrokenBodiesFindNothingPastTheBreak(t *testing.T) {
	keys := []string{"a", "b"}
	for _, body := range []string{``, `[]`, `{"a":1,`, `{"a":1 "b":2}`, `{"a":}`, `{"a"`, `"x"`} {
		out := []Span{{1, 2}, {1, 2}}
		err := FindFields([]byte(body), keys, out)
		if out[1].OK() {
			t.Errorf("%q: b found at %v", body, out[1])
		}
		if err == nil {
			t.Errorf("%q: no error", body)
		}
	}
}

// FindFields is the one pass over a vLLM prefill's reply: it refuses what
// Inspect refuses, with the same error, wherever the break is (after the
// keys too), and finds the keys of a whole object.
func TestFindFieldsValidatesAsInspect(t *testing.T) {
	keys := []string{"kv_transfer_params"}
	deep := strings.Repeat("[", maxDepth+2) + strings.Repeat("]", maxDepth+2)
	for _, body := range []string{`{"kv_transfer_params":{"a":1}} x`, `{"kv_transfer_params":{"a":1}}}`, `{"kv_transfer_params":1,"b":tru}`,
		`{"kv_transfer_params":1,"b":"\q"}`, `{"kv_transfer_params":1,"b":` + deep + `}`, `[1]`, `7`, ` `, `{} {}`,
		`{"kv_transfer_params":{"a":1}}`, ` {} `, "{\"b\":[1,2,{}],\n\"kv_transfer_params\":null}\n"} {
		var info Info
		want := Inspect([]byte(body), &info)
		out := make([]Span, 1)
		if got := FindFields([]byte(body), keys, out); got != want {
			t.Errorf("%.40q: FindFields says %v, Inspect %v", body, got, want)
		}
	}
}

// FuzzFindFields checks every span found is a whole JSON value of a valid
// object, at the top level.
func FuzzFindFields(f *testing.F) {
	for _, s := range []string{`{"a":1}`, `{"a":{"b":2},"b":[3]}`, `{"b":"x\"y"}`, `{}`, `{"a":1,}`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		keys := []string{"a", "b"}
		out := make([]Span, 2)
		err := FindFields(body, keys, out)
		var info Info
		if want := Inspect(body, &info); err != want {
			t.Fatalf("FindFields says %v, Inspect %v", err, want)
		}
		if err != nil {
			return
		}
		if bytes.IndexByte(body, '\\') >= 0 {
			return // an escaped key decodes to a name FindFields does not match, by design
		}
		var obj map[string]json.RawMessage
		if err := json.Unmarshal(body, &obj); err != nil {
			return
		}
		for k, key := range keys {
			want, ok := obj[key]
			if ok != out[k].OK() {
				t.Fatalf("%s: found %v, decoder %v", key, out[k].OK(), ok)
			}
			if ok && !json.Valid(body[out[k].Start:out[k].End]) {
				t.Fatalf("%s: span %q is not a value (decoder: %s)", key, body[out[k].Start:out[k].End], want)
			}
		}
	})
}
