package router

import (
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"
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
			got := m.feed(sse)
			if json.Valid(decode) && !json.Valid([]byte(strings.TrimSuffix(strings.TrimPrefix(string(got), "data: "), "\n\n"))) {
				t.Fatalf("streamed event became invalid: %q", got)
			}
		}
	})
}

// FuzzLogprobMergerStreamsAsJSONMerges: however an event is cut into
// chunks, streaming it merges exactly what merging it whole does.
func FuzzLogprobMergerStreamsAsJSONMerges(f *testing.F) {
	f.Add([]byte(`{"meta_info":{"input_token_logprobs":[[2]]}}`), 5)
	f.Add([]byte(`{"a":"meta_info","meta_info":{"x":{"input_token_logprobs":1},"input_token_logprobs":[ ]}}`), 17)
	f.Add([]byte(`{"meta_info":{"input_token_logprobs":null},"input_token_logprobs":[1]}`), 1)
	f.Add([]byte(`{"meta_info":1,"meta_info":{"input_token_logprobs":[1]}}`), 30)
	f.Add([]byte(`{"meta\"_info":{"input_token_logprobs":[1]},"k":"\\"}`), 9)
	prefill := []byte(`{"meta_info":{"input_token_logprobs":[[null,1,null],[-0.5,2,null]]}}`)
	f.Fuzz(func(t *testing.T, decode []byte, cut int) {
		if !json.Valid(decode) || strings.ContainsAny(string(decode), "\r\n") {
			return
		}
		event := "data: " + string(decode) + "\n\n"
		want := "data: " + string(mergeLogprobsJSON(prefill, decode)) + "\n\n"
		m := newLogprobMerger(prefill)
		cut = max(cut, 1)
		var got []byte
		for i := 0; i < len(event); i += cut {
			got = append(got, m.feed([]byte(event[i:min(i+cut, len(event))]))...)
		}
		if string(got) != want {
			t.Fatalf("streamed in %d-byte chunks:\n got %q\nwant %q", cut, got, want)
		}
	})
}

// bigLogprobsEvent is one SSE event whose input_token_logprobs holds n
// entries, as SGLang sends for a long prompt.
func bigLogprobsEvent(n int) []byte {
	ev := []byte(`data: {"text":"x","meta_info":{"id":"d","input_token_logprobs":[`)
	for i := range n {
		if i > 0 {
			ev = append(ev, ',')
		}
		ev = append(ev, `[-0.12345678,`...)
		ev = strconv.AppendInt(ev, int64(i), 10)
		ev = append(ev, `,null]`...)
	}
	return append(ev, "]}}\n\n"...)
}

// A multi-MB event passes chunk by chunk as it arrives, the merger holding
// nothing back and allocating no more than a chunk or two for it (it once
// reassembled the event, copying it again for every chunk).
func TestLogprobMergerPassesALargeEventAsItArrives(t *testing.T) {
	prefill := []byte(`{"meta_info":{"input_token_logprobs":[[null,1,null]]}}`)
	event := bigLogprobsEvent(1 << 20) // about 24 MB
	m := newLogprobMerger(prefill)
	const chunk = 32 << 10
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	var total int
	for i := 0; i < len(event); i += chunk {
		in := event[i:min(i+chunk, len(event))]
		out := m.feed(in)
		if len(out) < len(in) {
			t.Fatalf("chunk at %d: %d bytes in, %d out: the event is held back", i, len(in), len(out))
		}
		total += len(out)
	}
	runtime.ReadMemStats(&after)
	if want := len(event) + len(`[null,1,null],`); total != want {
		t.Errorf("%d bytes out, want %d", total, want)
	}
	if alloc := after.TotalAlloc - before.TotalAlloc; alloc > 4*chunk {
		t.Errorf("merging a %d MB event allocated %d bytes", len(event)>>20, alloc)
	}
}

// Issue 26 item 1: a decode's multi-MB logprobs event reaches the client
// while the decode is still sending it, merged, and the stream stays usable
// to its end.
func TestPDStreamPassesALargeLogprobsEventWhileItArrives(t *testing.T) {
	defer leakCheck(t)
	prefill := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		io.WriteString(w, `data: {"meta_info":{"input_token_logprobs":[[null,1,null]]}}`+"\n\ndata: [DONE]\n\n")
	}))
	defer prefill.Close()
	event := bigLogprobsEvent(200_000) // about 4.6 MB
	half := len(event) / 2
	release := make(chan struct{})
	decode := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		w.Write(event[:half])
		w.(http.Flusher).Flush()
		select {
		case <-release:
		case <-r.Context().Done():
			return
		}
		w.Write(event[half:])
		io.WriteString(w, "data: [DONE]\n\n")
	}))
	defer decode.Close()
	cfg := DefaultConfig()
	cfg.PDDisaggregation = true
	cfg.Prefill = []PrefillSpec{{URL: prefill.URL, BootstrapPort: 8998}}
	cfg.Decode = []string{decode.URL}
	base, srv := serveInProcess(t, cfg)
	defer shutdown(t, srv)

	resp, err := http.Post(base+"/generate", "application/json",
		strings.NewReader(`{"text":"a","stream":true,"return_logprob":true}`))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	got := make(chan []byte, 1)
	go func() {
		b := make([]byte, half)
		n, _ := io.ReadAtLeast(resp.Body, b, half-64<<10)
		got <- b[:n]
	}()
	var first []byte
	select {
	case first = <-got:
	case <-time.After(10 * time.Second):
		close(release)
		t.Fatal("no bytes of the event reached the client while the decode held its second half")
	}
	wantStart := `data: {"text":"x","meta_info":{"id":"d","input_token_logprobs":[[null,1,null],[-0.12345678,0,null]`
	if !strings.HasPrefix(string(first), wantStart) {
		t.Errorf("stream starts %q, want %q", first[:min(len(first), len(wantStart))], wantStart)
	}
	close(release)
	rest, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	events := sseEvents(string(first) + string(rest))
	if len(events) != 2 || events[1] != "data: [DONE]" {
		t.Fatalf("%d events, want the big one and [DONE]", len(events))
	}
	var out struct {
		MetaInfo struct {
			InputTokenLogprobs []json.RawMessage `json:"input_token_logprobs"`
		} `json:"meta_info"`
	}
	if err := json.Unmarshal([]byte(strings.TrimPrefix(events[0], "data: ")), &out); err != nil {
		t.Fatalf("merged event is not JSON: %v", err)
	}
	if n := len(out.MetaInfo.InputTokenLogprobs); n != 200_001 {
		t.Errorf("merged event has %d input logprobs, want 200001", n)
	}
}

// BenchmarkLogprobMergerLargeEvent: merging one 24 MB event as it streams
// in 32 KiB reads (the probe's 20 MB event once took 8.7 CPU-seconds), with
// the array first (the rest is skipped) and last (all of it is scanned).
func BenchmarkLogprobMergerLargeEvent(b *testing.B) {
	prefill := []byte(`{"meta_info":{"input_token_logprobs":[[null,1,null]]}}`)
	big := bigLogprobsEvent(1 << 20)
	arrayLast := append([]byte(`data: {"output_token_logprobs":`), big[len(`data: {"text":"x","meta_info":{"id":"d","input_token_logprobs":`):len(big)-len("}}\n\n")]...)
	arrayLast = append(arrayLast, `,"meta_info":{"input_token_logprobs":[[0]]}}`+"\n\n"...)
	for _, c := range []struct {
		name  string
		event []byte
	}{{"array-first", big}, {"array-last", arrayLast}} {
		b.Run(c.name, func(b *testing.B) {
			b.SetBytes(int64(len(c.event)))
			for b.Loop() {
				m := newLogprobMerger(prefill)
				for i := 0; i < len(c.event); i += 32 << 10 {
					m.feed(c.event[i:min(i+32<<10, len(c.event))])
				}
			}
		})
	}
}
