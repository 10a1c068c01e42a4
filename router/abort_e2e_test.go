package router_test

import (
	"bufio"
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/pdrouter/pdrouter/mock/mockworker"
)

func (w worker) aborts(t *testing.T) []mockworker.RecordedAbort {
	t.Helper()
	var out []mockworker.RecordedAbort
	getJSON(t, w.URL()+"/_mock/aborts", &out)
	return out
}

// ridOf is the rid a worker's last recorded request carried.
func ridOf(t *testing.T, w worker) string {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		if rs := w.requests(t); len(rs) > 0 {
			var body struct {
				RID string `json:"rid"`
			}
			if err := json.Unmarshal([]byte(rs[len(rs)-1].Body), &body); err != nil {
				t.Fatalf("worker %s body: %v", w.Addr, err)
			}
			return body.RID
		}
		if time.Now().After(deadline) {
			t.Fatalf("worker %s got no request", w.Addr)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// waitAbort waits until w has been told to abort rid, no later than within
// of since, and returns when it arrived.
func waitAbort(t *testing.T, w worker, rid string, since time.Time, within time.Duration) {
	t.Helper()
	for {
		for _, a := range w.aborts(t) {
			if a.RID == rid {
				if at := time.Unix(0, a.UnixNano); at.Sub(since) > within {
					t.Errorf("worker %s: abort of %s came %v after the client left, want within %v", w.Addr, rid, at.Sub(since), within)
				}
				return
			}
		}
		if time.Since(since) > within+2*time.Second {
			t.Fatalf("worker %s: no abort of %s; aborts %+v", w.Addr, rid, w.aborts(t))
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// leave sends body and goes away: after headers arrive and the first SSE
// event is read when firstByte, else after wait. It returns when it left.
func leave(t *testing.T, url, body string, firstByte bool, wait time.Duration, header ...string) time.Time {
	t.Helper()
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, "POST", url, strings.NewReader(body))
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return
		}
		defer resp.Body.Close()
		if firstByte {
			if _, err := bufio.NewReader(resp.Body).ReadString('\n'); err != nil {
				t.Errorf("no first line: %v", err)
			}
			cancel()
		}
	}()
	if firstByte {
		<-done
	} else {
		time.Sleep(wait)
		cancel()
		<-done
	}
	return time.Now()
}

func TestPDAbortOnClientDisconnect(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name      string
		body      string
		decode    []string
		firstByte bool
	}{
		{"non-streaming", `{"text":"a b c"}`, []string{"--prefill-delay", "10s"}, false},
		{"streaming before first byte", `{"text":"a b c","stream":true}`, []string{"--prefill-delay", "10s"}, false},
		{"streaming after first byte", `{"text":"a b c","stream":true}`, []string{"--tokens", "200", "--token-delay", "50ms"}, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			p := startWorker(t, "prefill", "--prefill-delay", "10s")
			d := startWorker(t, "decode", c.decode...)
			r := pd(t, []worker{p}, []worker{d})
			left := leave(t, r.url+"/generate", c.body, c.firstByte, 300*time.Millisecond)
			rid := ridOf(t, d)
			if len(rid) != 32 || ridOf(t, p) != rid {
				t.Fatalf("legs carry rids %q (decode) and %q (prefill), want one 32-hex rid", rid, ridOf(t, p))
			}
			waitAbort(t, p, rid, left, time.Second)
			waitAbort(t, d, rid, left, time.Second)
		})
	}
}

func TestPDAbortAfterRequestTimeout(t *testing.T) {
	t.Parallel()
	p := startWorker(t, "prefill", "--prefill-delay", "10s")
	d := startWorker(t, "decode", "--prefill-delay", "10s")
	r := pd(t, []worker{p}, []worker{d}, "--request-timeout-secs", "1")
	resp, b := post(t, r.url+"/generate", `{"text":"a b c","rid":"client-rid-7"}`)
	answered := time.Now()
	if resp.StatusCode != 504 {
		t.Fatalf("status %d: %s", resp.StatusCode, b)
	}
	// The client's own rid is kept, on both legs and in the aborts.
	if ridOf(t, p) != "client-rid-7" || ridOf(t, d) != "client-rid-7" {
		t.Fatalf("rids %q %q, want the client's", ridOf(t, p), ridOf(t, d))
	}
	waitAbort(t, p, "client-rid-7", answered, time.Second)
	waitAbort(t, d, "client-rid-7", answered, time.Second)
}

// Engines that finished a request hear nothing; a batch's rid is aborted
// per element, as SGLang expands it.
func TestPDAbortOnlyWhatIsHeld(t *testing.T) {
	t.Parallel()
	p := startWorker(t, "prefill")
	d := startWorker(t, "decode", "--tokens", "2")
	r := pd(t, []worker{p}, []worker{d})
	for _, body := range []string{`{"text":"a b"}`, `{"text":"a b","stream":true}`} {
		if resp, b := post(t, r.url+"/generate", body); resp.StatusCode != 200 {
			t.Fatalf("status %d: %s", resp.StatusCode, b)
		}
	}
	time.Sleep(300 * time.Millisecond)
	if n, m := len(p.aborts(t)), len(d.aborts(t)); n+m != 0 {
		t.Fatalf("completed requests were aborted: %+v %+v", p.aborts(t), d.aborts(t))
	}

	slow := startWorker(t, "decode", "--prefill-delay", "10s")
	r2 := pd(t, []worker{p}, []worker{slow})
	left := leave(t, r2.url+"/generate", `{"text":["a b","c d"]}`, false, 300*time.Millisecond)
	rid := ridOf(t, slow)
	waitAbort(t, slow, rid+"_0", left, time.Second)
	waitAbort(t, slow, rid+"_1", left, time.Second)
}

func TestRegularAbortOnClientDisconnect(t *testing.T) {
	t.Parallel()
	w := startWorker(t, "regular", "--prefill-delay", "10s", "--api-key", "wk")
	r := startRouter(t, "--worker-urls", w.URL(), "--policy", "round_robin", "--api-key", "wk")
	left := leave(t, r.url+"/v1/chat/completions", `{"model":"mock","messages":[{"role":"user","content":"hi"}]}`, false, 300*time.Millisecond,
		"Authorization", "Bearer wk")
	rid := ridOf(t, w)
	waitAbort(t, w, rid, left, time.Second)
	if a := w.aborts(t); a[0].AuthHeader != "Bearer wk" {
		t.Errorf("abort sent with Authorization %q, want the worker's key", a[0].AuthHeader)
	}
}

func TestAbortsOff(t *testing.T) {
	t.Parallel()
	p := startWorker(t, "prefill", "--prefill-delay", "10s")
	d := startWorker(t, "decode", "--prefill-delay", "10s")
	r := pd(t, []worker{p}, []worker{d}, "--engine-abort-timeout-ms", "0")
	leave(t, r.url+"/generate", `{"text":"a b c"}`, false, 300*time.Millisecond)
	if rid := ridOf(t, d); rid != "" {
		t.Errorf("rid %q injected with aborts off", rid)
	}
	time.Sleep(500 * time.Millisecond)
	if n := len(p.aborts(t)) + len(d.aborts(t)); n != 0 {
		t.Errorf("%d aborts sent with aborts off", n)
	}
}
