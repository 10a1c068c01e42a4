package balancer

import (
	"encoding/json"
	"testing"
)

// FuzzParseLoad: a worker's /get_load reply is untrusted input; any bytes
// give a load or an error, and a valid SGLang array sums its num_tokens.
func FuzzParseLoad(f *testing.F) {
	for _, s := range []string{`[{"dp_rank":0,"num_reqs":2,"num_waiting_reqs":0,"num_tokens":17}]`, `{"load":3}`,
		`[{"num_tokens":1},{"num_tokens":2}]`, `[]`, `null`, `[{"num_tokens":-5}]`, `{"load":1e30}`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		got, err := parseLoad(body, -1)
		var arr []struct {
			NumTokens int64 `json:"num_tokens"`
		}
		if json.Unmarshal(body, &arr) != nil {
			return
		}
		var want int64
		for _, e := range arr {
			want += e.NumTokens
		}
		if err != nil || (arr != nil && got != want && !hasLoadField(body)) {
			t.Fatalf("parseLoad(%s) = %d, %v; want %d", body, got, err, want)
		}
	})
}

// hasLoadField: entries may carry the legacy "load" instead of num_tokens.
func hasLoadField(body []byte) bool {
	var arr []map[string]json.RawMessage
	if json.Unmarshal(body, &arr) != nil {
		return false
	}
	for _, e := range arr {
		if _, ok := e["load"]; ok {
			return true
		}
	}
	return false
}
