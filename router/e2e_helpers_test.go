package router_test

import (
	"bufio"
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/pdrouter/pdrouter/mock/mockworker"
	"github.com/pdrouter/pdrouter/testkit/testenv"
)

// worker is a running mockworker binary.
type worker struct{ *testenv.Proc }

func startWorker(t *testing.T, role string, args ...string) worker {
	t.Helper()
	p := testenv.StartWith(t, testenv.Binary(t, "mockworker"), testenv.Options{Ready: "listening on "},
		append([]string{"--role", role, "--port", "0"}, args...)...)
	return worker{p}
}

func (w worker) requests(t *testing.T) []mockworker.RecordedRequest {
	t.Helper()
	var out []mockworker.RecordedRequest
	getJSON(t, w.URL()+"/_mock/requests", &out)
	return out
}

func (w worker) stats(t *testing.T) mockworker.Stats {
	t.Helper()
	var s mockworker.Stats
	getJSON(t, w.URL()+"/_mock/stats", &s)
	return s
}

// waitStats polls the worker's counters until ok accepts them.
func (w worker) waitStats(t *testing.T, d time.Duration, what string, ok func(mockworker.Stats) bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for {
		s := w.stats(t)
		if ok(s) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("worker %s: %s not seen within %v; stats %+v", w.Addr, what, d, s)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// router is a running pdrouter binary.
type router struct {
	*testenv.Proc
	url, metrics string
}

// startRouter runs pdrouter with args and waits until /readiness is 200
// (or only until it listens when wantReady is false).
func startRouterOpts(t *testing.T, wantReady bool, args ...string) router {
	t.Helper()
	port, prom := testenv.FreePort(t), testenv.FreePort(t)
	all := append([]string{"--host", "127.0.0.1", "--port", strconv.Itoa(port),
		"--prometheus-host", "127.0.0.1", "--prometheus-port", strconv.Itoa(prom), "--log-level", "warn"}, args...)
	p := testenv.Start(t, testenv.Binary(t, "pdrouter"), all...)
	r := router{Proc: p, url: "http://127.0.0.1:" + strconv.Itoa(port), metrics: "http://127.0.0.1:" + strconv.Itoa(prom) + "/metrics"}
	if wantReady {
		testenv.WaitStatus(t, r.url+"/readiness", 200, 30*time.Second)
		// Readiness needs one worker per role; tests want them all.
		workers, flag, key := 0, "", ""
		for i, a := range args {
			switch {
			case strings.HasPrefix(a, "--"):
				flag = a
				if a == "--api-key" && i+1 < len(args) {
					key = args[i+1]
				}
			case strings.HasPrefix(a, "http://") && (flag == "--worker-urls" || flag == "--prefill" || flag == "--decode"):
				workers++
			}
		}
		deadline := time.Now().Add(30 * time.Second)
		for {
			var list struct {
				Total int `json:"total"`
			}
			req, _ := http.NewRequest("GET", r.url+"/workers", nil)
			req.Header.Set("Authorization", "Bearer "+key)
			if resp, err := client.Do(req); err == nil {
				json.NewDecoder(resp.Body).Decode(&list)
				resp.Body.Close()
			}
			if list.Total >= workers {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("only %d of %d workers registered", list.Total, workers)
			}
			time.Sleep(10 * time.Millisecond)
		}
	} else {
		testenv.WaitStatus(t, r.url+"/health", 200, 30*time.Second)
	}
	return r
}

func startRouter(t *testing.T, args ...string) router { return startRouterOpts(t, true, args...) }

// pd starts a router in PD mode over the given workers, with round robin.
func pd(t *testing.T, prefills []worker, decodes []worker, extra ...string) router {
	t.Helper()
	args := []string{"--pd-disaggregation", "--policy", "round_robin"}
	for i, p := range prefills {
		port := strconv.Itoa(8998 + i)
		if i%2 == 1 {
			port = "none"
		}
		args = append(args, "--prefill", p.URL(), port)
	}
	for _, d := range decodes {
		args = append(args, "--decode", d.URL())
	}
	return startRouter(t, append(args, extra...)...)
}

var client = &http.Client{Timeout: 60 * time.Second}

func getJSON(t *testing.T, url string, v any) {
	t.Helper()
	resp, err := client.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if err := json.Unmarshal(body, v); err != nil {
		t.Fatalf("GET %s: %v: %s", url, err, body)
	}
}

func post(t *testing.T, url, body string, header ...string) (*http.Response, []byte) {
	t.Helper()
	return send(t, "POST", url, body, header...)
}

func get(t *testing.T, url string, header ...string) (*http.Response, []byte) {
	t.Helper()
	return send(t, "GET", url, "", header...)
}

// send makes one request with header name/value pairs and reads the reply.
func send(t *testing.T, method, url, body string, header ...string) (*http.Response, []byte) {
	t.Helper()
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	return testenv.Do(t, client, req)
}

// sseEvents splits an SSE body into its data payloads.
func sseEvents(body []byte) []string {
	var out []string
	sc := bufio.NewScanner(bytes.NewReader(body))
	sc.Buffer(make([]byte, 1<<20), 1<<24)
	for sc.Scan() {
		if d, ok := strings.CutPrefix(sc.Text(), "data: "); ok {
			out = append(out, d)
		}
	}
	return out
}

// errorBody is the OpenAI-style error the router sends.
type errorBody struct {
	Error struct {
		Message string `json:"message"`
		Type    string `json:"type"`
		Code    string `json:"code"`
	} `json:"error"`
}

func decodeError(t *testing.T, b []byte) errorBody {
	t.Helper()
	var e errorBody
	if err := json.Unmarshal(b, &e); err != nil || e.Error.Code == "" {
		t.Fatalf("not an OpenAI error body (%v): %s", err, b)
	}
	return e
}
