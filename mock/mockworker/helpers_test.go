package mockworker

import (
	"bufio"
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

type harness struct {
	t      *testing.T
	s      *Server
	client *http.Client
}

// start runs a mock on an ephemeral port, closed with the test.
func start(t *testing.T, cfg Config) *harness {
	t.Helper()
	s, err := Start(cfg)
	if err != nil {
		t.Fatal(err)
	}
	tr := &http.Transport{}
	t.Cleanup(func() {
		tr.CloseIdleConnections()
		if err := s.Close(); err != nil {
			t.Errorf("close: %v", err)
		}
	})
	return &harness{t: t, s: s, client: &http.Client{Transport: tr}}
}

func (h *harness) do(method, path, body string, hdr ...string) *http.Response {
	h.t.Helper()
	req, err := http.NewRequest(method, h.s.URL()+path, strings.NewReader(body))
	if err != nil {
		h.t.Fatal(err)
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := h.client.Do(req)
	if err != nil {
		h.t.Fatal(err)
	}
	return resp
}

// post returns status, X-Worker-Id and the body.
func (h *harness) post(path, body string, hdr ...string) (int, http.Header, []byte) {
	h.t.Helper()
	resp := h.do(http.MethodPost, path, body, hdr...)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		h.t.Fatal(err)
	}
	return resp.StatusCode, resp.Header, b
}

func (h *harness) get(path string) (int, []byte) {
	h.t.Helper()
	resp := h.do(http.MethodGet, path, "")
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		h.t.Fatal(err)
	}
	return resp.StatusCode, b
}

// postJSON expects a 200 and decodes the body into a generic value.
func (h *harness) postJSON(path, body string) map[string]any {
	h.t.Helper()
	code, _, b := h.post(path, body)
	if code != http.StatusOK {
		h.t.Fatalf("POST %s: %d %s", path, code, b)
	}
	return decodeObj(h.t, b)
}

func decodeObj(t *testing.T, b []byte) map[string]any {
	t.Helper()
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatalf("not a JSON object: %v: %s", err, b)
	}
	return m
}

// parseSSE splits a complete SSE body into its data payloads, checking the
// framing: only "data: X" events separated by blank lines, ending in [DONE].
func parseSSE(t *testing.T, body []byte) []map[string]any {
	t.Helper()
	if !bytes.HasSuffix(body, []byte("data: [DONE]\n\n")) {
		t.Fatalf("stream does not end with [DONE]: %q", body)
	}
	var out []map[string]any
	events := strings.Split(strings.TrimSuffix(string(body), "\n\n"), "\n\n")
	for i, ev := range events {
		payload, ok := strings.CutPrefix(ev, "data: ")
		if !ok || strings.Contains(payload, "\n") {
			t.Fatalf("bad SSE event %d: %q", i, ev)
		}
		if i == len(events)-1 {
			break // [DONE]
		}
		out = append(out, decodeObj(t, []byte(payload)))
	}
	return out
}

// readEvents reads SSE data payloads from a live stream as they arrive.
func readEvents(r io.Reader) <-chan string {
	ch := make(chan string)
	go func() {
		defer close(ch)
		sc := bufio.NewScanner(r)
		for sc.Scan() {
			if p, ok := strings.CutPrefix(sc.Text(), "data: "); ok {
				ch <- p
			}
		}
	}()
	return ch
}

// path walks a decoded JSON value: strings index objects, ints arrays.
func path(t *testing.T, v any, keys ...any) any {
	t.Helper()
	for _, k := range keys {
		switch k := k.(type) {
		case string:
			m, ok := v.(map[string]any)
			if !ok {
				t.Fatalf("%v: not an object at %q", v, k)
			}
			if v, ok = m[k]; !ok {
				t.Fatalf("missing key %q in %v", k, m)
			}
		case int:
			a, ok := v.([]any)
			if !ok || k >= len(a) {
				t.Fatalf("%v: no index %d", v, k)
			}
			v = a[k]
		}
	}
	return v
}

func num(t *testing.T, v any, keys ...any) int {
	t.Helper()
	f, ok := path(t, v, keys...).(float64)
	if !ok {
		t.Fatalf("not a number at %v in %v", keys, v)
	}
	return int(f)
}

func arrLen(t *testing.T, v any, keys ...any) int {
	t.Helper()
	a, ok := path(t, v, keys...).([]any)
	if !ok {
		t.Fatalf("not an array at %v in %v", keys, v)
	}
	return len(a)
}
