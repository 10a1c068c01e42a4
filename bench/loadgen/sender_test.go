package loadgen

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// scriptClock is the sender's clock in these tests. The fake server sets the time before it
// writes each chunk and then waits until the sender has read the clock for that chunk, so every
// timestamp the sender takes is exactly the scripted one, however slow the machine.
type scriptClock struct {
	mu    sync.Mutex
	t     time.Time
	reads chan struct{}
}

var epoch = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

func newScriptClock() *scriptClock {
	return &scriptClock{t: epoch, reads: make(chan struct{}, 64)}
}

func (c *scriptClock) Now() time.Time {
	c.mu.Lock()
	t := c.t
	c.mu.Unlock()
	c.reads <- struct{}{}
	return t
}

func (c *scriptClock) set(ms float64) {
	c.mu.Lock()
	c.t = epoch.Add(time.Duration(ms * float64(time.Millisecond)))
	c.mu.Unlock()
}

// awaitRead waits for the sender to read the clock.
func (c *scriptClock) awaitRead(t *testing.T) {
	select {
	case <-c.reads:
	case <-time.After(10 * time.Second):
		t.Error("sender never read the clock")
	}
}

// step is one scripted write: at ms, the server sends data; content says whether the sender
// should take a timestamp for it (and so whether the server waits for that read).
type step struct {
	ms      float64
	data    string
	content bool
}

// scriptedServer replays steps as an SSE stream (or as one JSON body when sse is false) and ends
// the reply at endMs.
func scriptedServer(t *testing.T, clk *scriptClock, sse bool, steps []step, endMs float64) *httptest.Server {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		clk.awaitRead(t) // the sender's start timestamp, taken before it sent the request
		if sse {
			w.Header().Set("Content-Type", "text/event-stream")
		} else {
			w.Header().Set("Content-Type", "application/json")
		}
		for _, s := range steps {
			clk.set(s.ms)
			fmt.Fprint(w, s.data)
			w.(http.Flusher).Flush()
			if s.content {
				clk.awaitRead(t)
			}
		}
		clk.set(endMs)
	}))
	t.Cleanup(srv.Close)
	return srv
}

func msd(v float64) time.Duration { return time.Duration(v * float64(time.Millisecond)) }

func msList(vs ...float64) []time.Duration {
	out := make([]time.Duration, len(vs))
	for i, v := range vs {
		out[i] = msd(v)
	}
	return out
}

func sse(json string) string { return "data: " + json + "\n\n" }

func TestSendTimesChunksExactly(t *testing.T) {
	chat := func(s string) string {
		return sse(`{"id":"x","choices":[{"index":0,"delta":{"content":"` + s + `"},"finish_reason":null}],"usage":null}`)
	}
	cases := []struct {
		name    string
		backend Backend
		sse     bool
		steps   []step
		end     float64
		want    Result
	}{{
		name: "chat with usage", backend: OpenAIChat, sse: true,
		steps: []step{
			{5, sse(`{"choices":[{"delta":{"role":"assistant","content":""}}]}`), false},
			{10, chat("Hel"), true},
			{30, chat("lo"), true},
			{60, chat("!"), true},
			{70, sse(`{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":4}}`), false},
			{75, "data: [DONE]\n\n", false},
		},
		end:  80,
		want: Result{TTFT: msd(10), ITL: msList(20, 30), Latency: msd(80), OutputLen: 4},
	}, {
		name: "completions without usage counts chunks", backend: OpenAI, sse: true,
		steps: []step{
			{12.5, sse(`{"choices":[{"text":"a"}]}`), true},
			{13, ": keep-alive comment\n\n", false},
			{20, sse(`{"choices":[{"text":""}]}`), false},
			{25, "event: x\r\ndata:{\"choices\":[{\"text\":\"b\"}]}\r\n\r\n", true},
			{26, "data: [DONE]\n\n", false},
		},
		end:  30,
		want: Result{TTFT: msd(12.5), ITL: msList(12.5), Latency: msd(30), OutputLen: 2},
	}, {
		name: "generate splits a multi-token chunk's gap", backend: SGLang, sse: true,
		steps: []step{
			{10, sse(`{"text":"a","meta_info":{"completion_tokens":1}}`), true},
			{15, sse(`{"text":"a","meta_info":{"completion_tokens":1}}`), false},
			{40, sse(`{"text":"a b c","meta_info":{"completion_tokens":3}}`), true},
			{50, sse(`{"text":"a b c d","meta_info":{"completion_tokens":4,"finish_reason":{"type":"length"}}}`), true},
			{52, "data: [DONE]\n\n", false},
		},
		end:  55,
		want: Result{TTFT: msd(10), ITL: msList(15, 15, 10), Latency: msd(55), OutputLen: 4},
	}, {
		name: "non-streamed reply: TTFT is E2E", backend: SGLang, sse: false,
		// The body ends only when the handler returns, so the sender reads the clock after that.
		steps: []step{{50, `{"text":"a b c","meta_info":{"completion_tokens":3}}`, false}},
		end:   50,
		want:  Result{TTFT: msd(50), ITL: []time.Duration{}, Latency: msd(50), OutputLen: 3},
	}}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			clk := newScriptClock()
			srv := scriptedServer(t, clk, c.sse, c.steps, c.end)
			s := NewSender(SenderConfig{BaseURL: srv.URL, Backend: c.backend, Now: clk.Now})
			defer s.Close()
			got := s.Send(context.Background(), &Request{Prompt: Prompt{InputLen: 7, OutputLen: 4}, Body: []byte("{}")})
			if got.Err != "" {
				t.Fatalf("error %s: %s", got.Err, got.Msg)
			}
			if got.TTFT != c.want.TTFT || got.Latency != c.want.Latency || got.OutputLen != c.want.OutputLen ||
				got.InputLen != 7 || !slices.Equal(got.ITL, c.want.ITL) || !got.Start.Equal(epoch) {
				t.Errorf("got TTFT %v ITL %v E2E %v out %d in %d start %v,\nwant TTFT %v ITL %v E2E %v out %d",
					got.TTFT, got.ITL, got.Latency, got.OutputLen, got.InputLen, got.Start,
					c.want.TTFT, c.want.ITL, c.want.Latency, c.want.OutputLen)
			}
		})
	}
}

// TestSendMetricsEndToEnd feeds scripted replies through Send and Compute and checks the
// bench_serving figures against values worked out by hand.
func TestSendMetricsEndToEnd(t *testing.T) {
	// Request A: content at 10, 30, 60 ms, usage says 4 tokens, ends at 80 ms.
	// Request B: content at 20, 25 ms, no usage (2 tokens counted from chunks), ends at 40 ms.
	scripts := [][]step{{
		{10, sse(`{"choices":[{"delta":{"content":"a"}}]}`), true},
		{30, sse(`{"choices":[{"delta":{"content":"b"}}]}`), true},
		{60, sse(`{"choices":[{"delta":{"content":"c"}}]}`), true},
		{70, sse(`{"choices":[],"usage":{"completion_tokens":4}}`), false},
	}, {
		{20, sse(`{"choices":[{"delta":{"content":"a"}}]}`), true},
		{25, sse(`{"choices":[{"delta":{"reasoning_content":"b"}}]}`), true},
	}}
	ends := []float64{80, 40}
	var results []Result
	for i, steps := range scripts {
		clk := newScriptClock()
		srv := scriptedServer(t, clk, true, steps, ends[i])
		s := NewSender(SenderConfig{BaseURL: srv.URL, Backend: OpenAIChat, Now: clk.Now})
		results = append(results, s.Send(context.Background(), &Request{Prompt: Prompt{InputLen: 10 * (i + 1)}}))
		s.Close()
	}
	m := Compute(results, 2*time.Second, SLO{TTFT: msd(15), TPOT: msd(30)})
	// TPOT A = (80-10)/3 = 23.33 ms, B = (40-20)/1 = 20 ms. ITLs: 20, 30, 5.
	// Goodput: A (TTFT 10 ≤ 15, TPOT 23.3 ≤ 30) is good, B (TTFT 20) is not.
	checks := []struct {
		name      string
		got, want float64
	}{
		{"completed", float64(m.Completed), 2},
		{"total input", float64(m.TotalInput), 30},
		{"total output", float64(m.TotalOutput), 6},
		{"request throughput", m.RequestThroughput, 1},
		{"input throughput", m.InputThroughput, 15},
		{"output throughput", m.OutputThroughput, 3},
		{"concurrency", m.Concurrency, 0.060},
		{"mean ttft", m.TTFT.Mean, 15},
		{"median ttft", m.TTFT.Median, 15},
		{"p99 ttft", m.TTFT.P99, 19.9},
		{"max ttft", m.TTFT.Max, 20},
		{"mean itl", m.ITL.Mean, 55.0 / 3},
		{"median itl", m.ITL.Median, 20},
		{"p90 itl", m.ITL.P90, 28},
		{"mean tpot", m.TPOT.Mean, (70.0/3 + 20) / 2},
		{"mean e2e", m.E2E.Mean, 60},
		{"p90 e2e", m.E2E.P90, 76},
		{"good", float64(m.Good), 1},
		{"goodput", m.Goodput, 0.5},
	}
	for _, c := range checks {
		if d := c.got - c.want; d > 1e-6 || d < -1e-6 {
			t.Errorf("%s = %v, want %v", c.name, c.got, c.want)
		}
	}
}

func TestSendClassifiesErrors(t *testing.T) {
	hang := make(chan struct{})
	mux := http.NewServeMux()
	mux.HandleFunc("/status/", func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, `{"error":{"message":"overloaded"}}`, http.StatusServiceUnavailable)
	})
	mux.HandleFunc("/hang/", func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body) // lets the server notice the client leaving
		select {
		case <-r.Context().Done():
		case <-hang:
		}
	})
	mux.HandleFunc("/cut/", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprint(w, sse(`{"choices":[{"delta":{"content":"a"}}]}`))
		w.(http.Flusher).Flush()
		conn, _, err := http.NewResponseController(w).Hijack()
		if err == nil {
			conn.Close() // the chunked body never ends
		}
	})
	sseReply := func(body string) http.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "text/event-stream")
			fmt.Fprint(w, body)
		}
	}
	mux.HandleFunc("/sse-error/", sseReply(sse(`{"choices":[{"delta":{"content":"a"}}]}`)+sse(`{"error":{"message":"engine died"}}`)+"data: [DONE]\n\n"))
	mux.HandleFunc("/sse-garbage/", sseReply(sse(`{"choices":[{"delta":{"content":"a"}}]}`)+"data: {'error': 'python dict'}\n\n"))
	mux.HandleFunc("/sse-empty/", sseReply("data: [DONE]\n\n"))
	srv := httptest.NewServer(mux)
	defer srv.Close()
	defer close(hang)

	dead, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	deadURL := "http://" + dead.Addr().String()
	dead.Close()

	cases := []struct{ base, want, msg string }{
		{srv.URL + "/status", "http_503", "overloaded"},
		{srv.URL + "/hang", ErrTimeout, ""},
		{srv.URL + "/cut", ErrTransport, ""},
		{srv.URL + "/sse-error", ErrStream, "engine died"},
		{srv.URL + "/sse-garbage", ErrStream, ""},
		{srv.URL + "/sse-empty", ErrStream, "no generated text"},
		{deadURL, ErrTransport, ""},
	}
	for _, c := range cases {
		timeout := 10 * time.Second // generous: a loaded machine must not turn the other cases into timeouts
		if c.want == ErrTimeout {
			timeout = 200 * time.Millisecond
		}
		s := NewSender(SenderConfig{BaseURL: c.base, Backend: OpenAIChat, Timeout: timeout})
		got := s.Send(context.Background(), &Request{Body: []byte("{}")})
		s.Close()
		if got.Err != c.want || !strings.Contains(got.Msg, c.msg) {
			t.Errorf("%s: got %q (%s), want %q containing %q", c.base, got.Err, got.Msg, c.want, c.msg)
		}
	}

	// Stopping the run is not a server error.
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(50*time.Millisecond, cancel)
	s := NewSender(SenderConfig{BaseURL: srv.URL + "/hang", Backend: OpenAIChat})
	defer s.Close()
	if got := s.Send(ctx, &Request{Body: []byte("{}")}); got.Err != errCancelled {
		t.Errorf("cancelled run: got %q, want %q", got.Err, errCancelled)
	}
}

func TestSendHeadersAndLongLines(t *testing.T) {
	long := strings.Repeat("x", 100<<10) // longer than the pooled reader's buffer
	var gotAuth, gotType, gotPath string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		gotAuth, gotType, gotPath = r.Header.Get("Authorization"), r.Header.Get("Content-Type"), r.URL.Path
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprint(w, sse(`{"choices":[{"text":"`+long+`"}]}`)+sse(`{"choices":[{"text":"y"}],"usage":{"completion_tokens":2}}`))
	}))
	defer srv.Close()
	s := NewSender(SenderConfig{BaseURL: srv.URL + "/", Backend: OpenAI, APIKey: "sk-test"})
	defer s.Close()
	got := s.Send(context.Background(), &Request{Body: []byte("{}")})
	if got.Err != "" || got.OutputLen != 2 || len(got.ITL) != 1 {
		t.Errorf("got %+v", got)
	}
	if gotAuth != "Bearer sk-test" || gotType != "application/json" || gotPath != "/v1/completions" {
		t.Errorf("headers: auth %q type %q path %q", gotAuth, gotType, gotPath)
	}
}

func TestDiscoverModel(t *testing.T) {
	var auth string
	mux := http.NewServeMux()
	mux.HandleFunc("/ok/v1/models", func(w http.ResponseWriter, r *http.Request) {
		auth = r.Header.Get("Authorization")
		fmt.Fprint(w, `{"object":"list","data":[{"id":"meta/llama","object":"model"},{"id":"other"}]}`)
	})
	mux.HandleFunc("/empty/v1/models", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprint(w, `{"object":"list","data":[]}`)
	})
	srv := httptest.NewServer(mux)
	defer srv.Close()
	ctx := context.Background()
	if m, err := DiscoverModel(ctx, srv.URL+"/ok", "k"); m != "meta/llama" || err != nil || auth != "Bearer k" {
		t.Errorf("got %q, %v (auth %q)", m, err, auth)
	}
	if _, err := DiscoverModel(ctx, srv.URL+"/empty", ""); err == nil {
		t.Error("an empty model list should fail")
	}
	if _, err := DiscoverModel(ctx, srv.URL+"/missing", ""); err == nil || !strings.Contains(err.Error(), "404") {
		t.Errorf("a 404 should fail with its status, got %v", err)
	}
}

// BenchmarkSendStream measures the client's cost per streamed request (256 chunks): allocations
// must not grow with the number of chunks beyond the ITL slice.
func BenchmarkSendStream(b *testing.B) {
	var body strings.Builder
	for range 256 {
		body.WriteString(sse(`{"id":"chatcmpl-1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":" tok"},"finish_reason":null}]}`))
	}
	body.WriteString(sse(`{"choices":[],"usage":{"prompt_tokens":8,"completion_tokens":256}}`) + "data: [DONE]\n\n")
	reply := body.String()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		io.WriteString(w, reply)
	}))
	defer srv.Close()
	s := NewSender(SenderConfig{BaseURL: srv.URL, Backend: OpenAIChat})
	defer s.Close()
	req := &Request{Prompt: Prompt{OutputLen: 256}, Body: []byte(`{"stream":true}`)}
	b.ReportAllocs()
	for b.Loop() {
		if r := s.Send(context.Background(), req); r.Err != "" || r.OutputLen != 256 {
			b.Fatalf("%s %s", r.Err, r.Msg)
		}
	}
}
