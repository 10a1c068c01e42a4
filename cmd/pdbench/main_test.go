package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// engine is a fake OpenAI server: /v1/models names "served-model", chat replies stream three
// chunks. It records the bodies and the Authorization header it saw.
type engine struct {
	*httptest.Server
	delay  time.Duration
	served atomic.Int64
	mu     sync.Mutex
	bodies []map[string]any
	auth   string
}

func newEngine(t *testing.T, delay time.Duration) *engine {
	e := &engine{delay: delay}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /v1/models", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprint(w, `{"object":"list","data":[{"id":"served-model"}]}`)
	})
	mux.HandleFunc("POST /v1/chat/completions", func(w http.ResponseWriter, r *http.Request) {
		var body map[string]any
		if err := json.NewDecoder(r.Body).Decode(&body); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		e.mu.Lock()
		e.bodies, e.auth = append(e.bodies, body), r.Header.Get("Authorization")
		e.mu.Unlock()
		select {
		case <-time.After(e.delay):
		case <-r.Context().Done():
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		for _, c := range []string{"a", "b", "c"} {
			fmt.Fprintf(w, "data: {\"choices\":[{\"delta\":{\"content\":%q}}]}\n\n", c)
		}
		fmt.Fprint(w, "data: {\"choices\":[],\"usage\":{\"completion_tokens\":3}}\n\ndata: [DONE]\n\n")
		e.served.Add(1)
	})
	e.Server = httptest.NewServer(mux)
	t.Cleanup(e.Close)
	return e
}

func readRecords(t *testing.T, path string) []map[string]any {
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var recs []map[string]any
	for line := range strings.Lines(string(b)) {
		var rec map[string]any
		if err := json.Unmarshal([]byte(line), &rec); err != nil {
			t.Fatalf("%q: %v", line, err)
		}
		recs = append(recs, rec)
	}
	return recs
}

func TestRunWritesReportFileAndPlot(t *testing.T) {
	e := newEngine(t, 0)
	t.Setenv("OPENAI_API_KEY", "sk-bench")
	dir := t.TempDir()
	out, plot := filepath.Join(dir, "out.jsonl"), filepath.Join(dir, "plot.html")
	var stdout, stderr bytes.Buffer
	err := run(context.Background(), []string{"--backend", "openai-chat", "--base-url", e.URL,
		"--dataset-name", "random", "--num-prompts", "12", "--random-input-len", "8", "--random-output-len", "3",
		"--request-rate", "500", "--max-concurrency", "4", "--warmup-requests", "2", "--seed", "9",
		"--extra-request-body", `{"top_k":5}`, "--slo-ttft-ms", "1000",
		"--output-file", out, "--output-details", "--plot", plot}, &stdout, &stderr, false)
	if err != nil {
		t.Fatalf("%v\n%s", err, stderr.String())
	}
	if e.served.Load() != 14 {
		t.Errorf("served %d, want 12 + 2 warm-ups", e.served.Load())
	}
	e.mu.Lock()
	body, auth := e.bodies[0], e.auth
	e.mu.Unlock()
	if body["model"] != "served-model" || body["top_k"] != 5.0 || body["stream"] != true || auth != "Bearer sk-bench" {
		t.Errorf("request body %v, auth %q", body, auth)
	}
	recs := readRecords(t, out)
	if len(recs) != 1 {
		t.Fatalf("%d records", len(recs))
	}
	rec := recs[0]
	if rec["completed"] != 12.0 || rec["total_output_tokens"] != 36.0 || rec["model_id"] != "served-model" ||
		rec["max_concurrency"] != 4.0 || rec["request_rate"] != 500.0 || len(rec["itls"].([]any)) != 12 ||
		rec["request_goodput"] == nil || rec["partial"] != false {
		t.Errorf("record: %v", rec)
	}
	if !strings.Contains(stdout.String(), "Successful requests:") || !strings.Contains(stderr.String(), "12/12 done") {
		t.Errorf("stdout:\n%s\nstderr:\n%s", stdout.String(), stderr.String())
	}
	if page, err := os.ReadFile(plot); err != nil || !strings.Contains(string(page), "<svg") {
		t.Errorf("plot: %v", err)
	}
}

// TestRunInterrupted is Ctrl-C in-process: the table and the output file still come out, marked.
func TestRunInterrupted(t *testing.T) {
	e := newEngine(t, 20*time.Millisecond)
	out := filepath.Join(t.TempDir(), "out.jsonl")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		for e.served.Load() < 3 && ctx.Err() == nil {
			time.Sleep(time.Millisecond)
		}
		time.Sleep(10 * time.Millisecond)
		cancel()
	}()
	var stdout bytes.Buffer
	err := run(ctx, []string{"--backend", "openai-chat", "--model", "m", "--base-url", e.URL, "--num-prompts", "500",
		"--random-input-len", "4", "--random-output-len", "3", "--max-concurrency", "1", "--warmup-requests", "0", "--output-file", out},
		&stdout, io.Discard, false)
	if err != nil {
		t.Fatal(err)
	}
	rec := readRecords(t, out)[0]
	if rec["partial"] != true || rec["completed"].(float64) < 2 || rec["completed"].(float64) >= 500 {
		t.Errorf("record after interrupt: partial %v completed %v", rec["partial"], rec["completed"])
	}
	if !strings.Contains(stdout.String(), "Interrupted:") {
		t.Errorf("table does not say it was interrupted:\n%s", stdout.String())
	}
}

func TestRunRejectsBadFlags(t *testing.T) {
	for _, args := range [][]string{
		{"--backend", "tgi"},
		{"--dataset-name", "nope", "--model", "m"},
		{"--extra-request-body", "{", "--model", "m"},
		{"--dataset-name", "sharegpt", "--model", "m"},
		{"stray"},
		{"--backend", "openai", "--base-url", "http://127.0.0.1:1"}, // no --model and nothing to ask
	} {
		if err := run(context.Background(), args, io.Discard, io.Discard, false); err == nil {
			t.Errorf("%q: want an error", args)
		}
	}
}
