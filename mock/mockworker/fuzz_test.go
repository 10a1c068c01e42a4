package mockworker

import (
	"encoding/json"
	"testing"
)

// FuzzParseRequest: any body on any route is either a clean 400 or a request
// the answer code can rely on (items, bootstrap entries in range).
func FuzzParseRequest(f *testing.F) {
	for _, s := range []string{
		`{"text":"a b","sampling_params":{"max_new_tokens":3},"return_logprob":true}`,
		`{"input_ids":[[1,2],[3]],"bootstrap_host":["h","h"],"bootstrap_port":[null,1],"bootstrap_room":[1,2]}`,
		`{"text":["a","b"],"sampling_params":[{},{"max_new_tokens":0}],"return_logprob":[true,false]}`,
		`{"messages":[{"role":"user","content":[{"type":"text","text":"x"}]}],"n":3,"logprobs":true,"top_logprobs":2,` + boot + `}`,
		`{"prompt":[[1],[2]],"logprobs":2,"bootstrap_host":"h","bootstrap_room":[1,2]}`,
		`{"query":"q","documents":["a"]}`,
		`{"input":[{"role":"user","content":"x"}]}`,
		`{"input":"x"}`, `null`, `[]`, `{"text":null}`, `{"prompt":[]}`,
		`{"text":"a","routed_dp_rank":3,"disagg_prefill_dp_rank":0}`, `{"text":"a","data_parallel_rank":1,"routed_dp_rank":null}`,
		`{"text":"a","routed_dp_rank":4}`, `{"text":"a","routed_dp_rank":-1}`, `{"text":"a","data_parallel_rank":1.5}`,
	} {
		for ep := epGenerate; ep <= epResponses; ep++ {
			f.Add(uint8(ep), []byte(s))
		}
	}
	f.Fuzz(func(t *testing.T, e uint8, body []byte) {
		ep := endpoint(e % uint8(epResponses+1))
		r, err := parseRequest(ep, body, 4)
		if err != nil {
			if r != nil || err.status != 400 || err.message == "" || !json.Valid(errorBody(err.status, err.message)) {
				t.Fatalf("bad error %v %+v", r, err)
			}
			return
		}
		if r.ranks.rank < 0 || r.ranks.rank >= 4 {
			t.Fatalf("rank %d of 4", r.ranks.rank)
		}
		if len(r.items) == 0 || len(r.items) > maxChoices*64 {
			t.Fatalf("%d items", len(r.items))
		}
		if r.boot != nil {
			for i := range r.items {
				if e := r.entryOf(&r.items[i]); e < 0 || e >= len(r.boot) {
					t.Fatalf("entry %d of %d", e, len(r.boot))
				}
			}
		}
		if r.ep.generates() || r.ep == epResponses {
			for _, it := range r.items {
				if it.limit < -1 {
					t.Fatalf("limit %d", it.limit)
				}
			}
		}
	})
}
