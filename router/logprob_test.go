package router

import (
	"encoding/json"
	"strings"
	"testing"
)

func TestMergeLogprobsJSON(t *testing.T) {
	prefill := `{"text":"a","meta_info":{"input_token_logprobs":[[null,1,null],[-0.5,2,null]],"id":"p"}}`
	decode := `{"text":"b","meta_info":{"id":"d","input_token_logprobs":[[-0.1,3,null]]},"x":1}`
	got := string(mergeLogprobsJSON([]byte(prefill), []byte(decode)))
	want := `{"text":"b","meta_info":{"id":"d","input_token_logprobs":[[null,1,null],[-0.5,2,null],[-0.1,3,null]]},"x":1}`
	if got != want {
		t.Errorf("merged:\n got %s\nwant %s", got, want)
	}
	// A batch (array) reply or one without the field passes unchanged.
	for _, d := range []string{`[{"meta_info":{"input_token_logprobs":[]}}]`, `{"choices":[]}`} {
		if got := string(mergeLogprobsJSON([]byte(prefill), []byte(d))); got != d {
			t.Errorf("%s changed to %s", d, got)
		}
	}
	// Prefill answered as SSE (stream:true): its first event is used.
	sse := "data: " + prefill + "\n\ndata: [DONE]\n\n"
	if got := string(mergeLogprobsJSON([]byte(sse), []byte(decode))); got != want {
		t.Errorf("from SSE prefill: %s", got)
	}
}

func TestLogprobMergerAcrossChunkBoundaries(t *testing.T) {
	m := newLogprobMerger([]byte(`data: {"meta_info":{"input_token_logprobs":[[1]]}}` + "\n\n"))
	stream := `data: {"meta_info":{"input_token_logprobs":[[2]]}}` + "\n\n" + `data: {"meta_info":{"input_token_logprobs":[]}}` + "\n\n" + "data: [DONE]\n\n"
	var out strings.Builder
	for i := 0; i < len(stream); i += 7 { // 7-byte chunks split events anywhere
		out.Write(m.feed([]byte(stream[i:min(i+7, len(stream))])))
	}
	out.Write(m.flush())
	want := `data: {"meta_info":{"input_token_logprobs":[[1],[2]]}}` + "\n\n" + `data: {"meta_info":{"input_token_logprobs":[[1]]}}` + "\n\n" + "data: [DONE]\n\n"
	if out.String() != want {
		t.Errorf("got %q\nwant %q", out.String(), want)
	}
}

// FuzzMergeLogprobs: worker replies are untrusted; merging never panics and
// never turns a valid JSON reply into an invalid one.
func FuzzMergeLogprobs(f *testing.F) {
	f.Add([]byte(`{"meta_info":{"input_token_logprobs":[[1]]}}`), []byte(`{"meta_info":{"input_token_logprobs":[[2]]}}`))
	f.Add([]byte("data: {\"meta_info\":{\"input_token_logprobs\":[]}}\n\n"), []byte(`{"meta_info":{"input_token_logprobs":[ ]}}`))
	f.Add([]byte(`{"meta_info":1}`), []byte(`[1,2]`))
	f.Fuzz(func(t *testing.T, prefill, decode []byte) {
		out := mergeLogprobsJSON(prefill, decode)
		if json.Valid(decode) && !json.Valid(out) {
			t.Fatalf("valid reply became invalid:\nprefill %q\ndecode  %q\nout     %q", prefill, decode, out)
		}
		// An SSE event's data holds no newline, so only such replies stream.
		if m := newLogprobMerger(prefill); m != nil && !strings.Contains(string(decode), "\n") {
			sse := append([]byte("data: "), decode...)
			sse = append(sse, "\n\n"...)
			got := append(m.feed(sse), m.flush()...)
			if json.Valid(decode) && !json.Valid([]byte(strings.TrimSuffix(strings.TrimPrefix(string(got), "data: "), "\n\n"))) {
				t.Fatalf("streamed event became invalid: %q", got)
			}
		}
	})
}
