package router_test

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/pdrouter/pdrouter/testkit/testenv"
)

// rawRequest writes raw bytes on a fresh connection and reads the reply.
func rawRequest(t *testing.T, addr, raw string) (*http.Response, string) {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.WriteString(c, raw); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	return resp, string(b)
}

// seriesCount counts the exported smg_* samples.
func seriesCount(t *testing.T, metricsURL string) int {
	t.Helper()
	_, b := get(t, metricsURL)
	n := 0
	for _, l := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(l, "smg_") {
			n++
		}
	}
	return n
}

// Invented methods, paths and model names add no series, and an unknown
// method is a 405.
func TestMetricSeriesStayBounded(t *testing.T) {
	t.Parallel()
	w := startWorker(t, "regular")
	r := startRouter(t, "--worker-urls", w.URL(), "--policy", "round_robin")
	addr := strings.TrimPrefix(r.url, "http://")
	round := func(tag string) {
		for i := range 30 {
			resp, _ := rawRequest(t, addr, fmt.Sprintf("M%s%d /health HTTP/1.1\r\nHost: x\r\n\r\n", tag, i))
			if resp.StatusCode != 405 {
				t.Fatalf("invented method: status %d, want 405", resp.StatusCode)
			}
			get(t, r.url+fmt.Sprintf("/no/such/%s/%d", tag, i))
			post(t, r.url+"/generate", fmt.Sprintf(`{"text":"x","model":"m-%s-%d"}`, tag, i))
			post(t, r.url+"/v1/chat/completions", fmt.Sprintf(`{"model":"c-%s-%d","messages":[{"role":"user","content":"x"}]}`, tag, i))
		}
	}
	round("a")
	before := seriesCount(t, r.metrics)
	round("b")
	if after := seriesCount(t, r.metrics); after != before {
		t.Fatalf("smg_* samples grew from %d to %d under invented methods, paths and models", before, after)
	}
	_, b := get(t, r.metrics)
	if !strings.Contains(string(b), `method="OTHER"`) {
		t.Error("invented methods are not counted as OTHER")
	}
}

// A head over the limit is a 431 in OpenAI's error shape that repeats none
// of the request, and the logs do not show the credential either.
func TestOversizedHeadIs431WithoutEcho(t *testing.T) {
	t.Parallel()
	w := startWorker(t, "regular")
	r := startRouter(t, "--worker-urls", w.URL(), "--policy", "round_robin", "--max-header-size", "16384", "--log-level", "debug")
	addr := strings.TrimPrefix(r.url, "http://")
	const secret = "sk-this-must-never-be-echoed"
	big := strings.Repeat("a", 20000)
	resp, body := rawRequest(t, addr, "GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "+secret+"\r\nX-Big: "+big+"\r\n\r\n")
	if resp.StatusCode != 431 || resp.Header.Get("X-SMG-Error-Code") != "request_header_fields_too_large" {
		t.Fatalf("status %d code %q: %s", resp.StatusCode, resp.Header.Get("X-SMG-Error-Code"), body)
	}
	if e := decodeError(t, []byte(body)); e.Error.Message == "" {
		t.Fatalf("no OpenAI-style error: %s", body)
	}
	// 8 KiB of headers (over fasthttp's 4 KiB default) are served.
	if resp, _ := rawRequest(t, addr, "GET /health HTTP/1.1\r\nHost: x\r\nX-Big: "+big[:8000]+"\r\n\r\n"); resp.StatusCode != 200 {
		t.Fatalf("8 KB head: status %d", resp.StatusCode)
	}
	resp, body = rawRequest(t, addr, "GET /health HTTP/1.1\r\nAuthorization: Bearer "+secret+"\r\nbroken header line\r\n\r\n")
	if resp.StatusCode != 400 {
		t.Fatalf("malformed head: status %d: %s", resp.StatusCode, body)
	}
	time.Sleep(200 * time.Millisecond) // let the log lines land
	for what, s := range map[string]string{"error body": body, "log": r.Output()} {
		if strings.Contains(s, secret) {
			t.Errorf("%s repeats the credential", what)
		}
	}
}

// Over --max-connections a connection reads a 503 and is closed; a client
// that sends no head is closed after --header-read-timeout-secs.
func TestConnectionLimitAndHeaderTimeout(t *testing.T) {
	t.Parallel()
	w := startWorker(t, "regular")
	r := startRouter(t, "--worker-urls", w.URL(), "--policy", "round_robin", "--max-connections", "8", "--header-read-timeout-secs", "2")
	addr := strings.TrimPrefix(r.url, "http://")
	var idle []net.Conn
	for range 8 {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		_, _ = io.WriteString(c, "GET /health HTTP/1.1\r\nHost: x\r\n") // never finished
		idle = append(idle, c)
	}
	// A loaded box may not have accepted all eight yet: a ninth served
	// meanwhile is retried until the limit holds, well inside the 2 s
	// header timeout that frees the eight.
	for give := time.Now().Add(1500 * time.Millisecond); ; time.Sleep(50 * time.Millisecond) {
		resp, body := rawRequest(t, addr, "GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
		if resp.StatusCode == 503 && resp.Header.Get("X-SMG-Error-Code") == "too_many_connections" {
			break
		}
		if resp.StatusCode != 200 || time.Now().After(give) {
			t.Fatalf("over the limit: status %d: %s", resp.StatusCode, body)
		}
	}
	start := time.Now()
	for _, c := range idle {
		_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
		if _, err := io.ReadAll(c); err != nil {
			t.Fatalf("slow head not closed by the router: %v", err)
		}
	}
	if d := time.Since(start); d > 4*time.Second {
		t.Fatalf("slow heads closed after %v, want about 2 s", d)
	}
	testenv.WaitStatus(t, r.url+"/health", 200, 5*time.Second)
}

// With a low fd limit and a connection limit above it, accept runs out of
// descriptors: the router pauses, keeps running and serves once they free.
func TestRouterSurvivesEMFILE(t *testing.T) {
	t.Parallel()
	prlimit, err := exec.LookPath("prlimit")
	if err != nil {
		t.Skip("needs prlimit (util-linux)")
	}
	port := testenv.FreePort(t)
	url := "http://127.0.0.1:" + strconv.Itoa(port)
	p := testenv.Start(t, prlimit, "--nofile=128:128", testenv.Binary(t, "pdrouter"), "--host", "127.0.0.1", "--port", strconv.Itoa(port),
		"--prometheus-port", "0", "--max-connections", "10000", "--policy", "round_robin")
	testenv.WaitStatus(t, url+"/health", 200, 30*time.Second)
	var conns []net.Conn
	for range 200 {
		if c, err := net.DialTimeout("tcp", "127.0.0.1:"+strconv.Itoa(port), time.Second); err == nil {
			conns = append(conns, c)
		}
	}
	time.Sleep(300 * time.Millisecond)
	for _, c := range conns {
		_ = c.Close()
	}
	testenv.WaitStatus(t, url+"/health", 200, 10*time.Second)
	if !strings.Contains(p.Output(), "too many open files") {
		t.Error("accept never ran out of descriptors: the test proves nothing")
	}
	if strings.Contains(p.Output(), "router stopped") {
		t.Fatal("router stopped")
	}
}
