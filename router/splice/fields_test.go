package splice

import (
	"bytes"
	"encoding/json"
	"testing"
)

func TestFindFields(t *testing.T) {
	keys := []string{"stream", "max_tokens", "kv_transfer_params", "absent"}
	body := []byte(` { "messages":[{"content":"stream"}], "max_tokens" : 7,"stream":true,` +
		`"nested":{"max_tokens":1},"kv_transfer_params":{"a":[1,{"b":null}]},"max_tokens":9 }`)
	out := make([]Span, len(keys))
	FindFields(body, keys, out)
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
		FindFields([]byte(body), keys, out)
		if out[1].OK() {
			t.Errorf("%q: b found at %v", body, out[1])
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
		FindFields(body, keys, out)
		var info Info
		if Inspect(body, &info) != nil {
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
