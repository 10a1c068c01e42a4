package router

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/pdrouter/pdrouter/mock/mockworker"
)

// routerStacks returns the goroutine dumps that are not the in-process
// engine's (as routerGoroutines counts them).
func routerStacks() []string {
	buf := make([]byte, 64<<20)
	buf = buf[:runtime.Stack(buf, true)]
	var out []string
	for _, g := range strings.Split(string(buf), "\n\n") {
		if !strings.Contains(g, "mock/mockworker.") && !strings.Contains(g, "net/http.(*http2serverConn)") &&
			!strings.Contains(g, "net/http.(*conn).serve") {
			out = append(out, g)
		}
	}
	return out
}

// countStacks counts the dumps that contain every one of frames.
func countStacks(stacks []string, frames ...string) int {
	n := 0
next:
	for _, g := range stacks {
		for _, f := range frames {
			if !strings.Contains(g, f) {
				continue next
			}
		}
		n++
	}
	return n
}

// An open PD stream over h2c holds no goroutine, neither while it waits
// for its first token (it parks on its h2c stream: firstwait.go; older
// code held fasthttp's connection goroutine, 16-32 KiB deep, then the
// hijack handler's) nor between events: the h2c connection's reader
// starts one for its next event (a relay goroutine per stream, parked in
// awaitH2C, on older code).
func TestOpenStreamHoldsNoFasthttpGoroutine(t *testing.T) {
	const streams = 50
	// The first token after two seconds, the next ones a minute apart.
	base, srv, _, _ := h2cPD(t, mockworker.Config{}, mockworker.Config{PrefillDelay: 2 * time.Second, TokenDelay: time.Minute})
	if _, err := streamTokens(context.Background(), base, 1); err != nil { // the connections are up
		t.Fatal(err)
	}
	http.DefaultClient.CloseIdleConnections()
	goroutines := routerGoroutines()
	conns := make([]net.Conn, streams)
	for i := range conns {
		conns[i] = sendStream(t, base, 3)
		defer conns[i].Close()
	}
	waitFor(t, func() bool { return parkedStreams(srv) == streams })
	waitFor(t, func() bool { return countStacks(routerStacks(), "fasthttp.hijackConnHandler") == 0 })
	if n := countStacks(routerStacks(), "fasthttp.(*Server).serveConnCounted(", "(*Server).handle("); n != 0 {
		t.Errorf("%d streams in fasthttp's serveConn while %d streams wait for their first token, want none", n, streams)
	}
	for _, c := range conns { // the first event, then the wait for the next
		awaitFirstEvent(t, c)
	}
	waitFor(t, func() bool { return countStacks(routerStacks(), "fasthttp.hijackConnHandler") == 0 })
	stacks := routerStacks()
	if n := countStacks(stacks, "(*streamRelay)."); n != 0 {
		t.Errorf("%d streams hold a relay goroutine between events, want none", n)
	}
	if n := countStacks(stacks, "fasthttp.(*Server).serveConnCounted(", "(*Server).handle("); n != 0 {
		t.Errorf("%d streams in fasthttp's serveConn while %d streams wait between events, want none", n, streams)
	}
	// Goroutines of the set-up (the hijack handlers, the test client's
	// connections) take a moment to exit; one per stream never would.
	// fasthttp's idle pool workers are not counted (routerGoroutines).
	extra := func() int { return routerGoroutines() - goroutines }
	for deadline := time.Now().Add(5 * time.Second); extra() > streams/10 && time.Now().Before(deadline); {
		time.Sleep(20 * time.Millisecond)
	}
	if got := extra(); got > streams/10 {
		t.Errorf("%d more router goroutines with %d streams open between events, want none per stream", got, streams)
	}
}

// A stream's connection, hijacked, serves the client's next requests as
// fasthttp's own would: another stream, then a plain request; one that
// asks for Connection: close is then closed.
func TestStreamConnectionServesTheNextRequests(t *testing.T) {
	base, _, _, _ := h2cPD(t, mockworker.Config{}, mockworker.Config{})
	c, err := net.Dial("tcp", strings.TrimPrefix(base, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	br := bufio.NewReader(c)
	for i, req := range []struct {
		body   string
		header string
	}{
		{`{"text":"a b c","stream":true,"sampling_params":{"max_new_tokens":3}}`, ""},
		{`{"text":"a b c","stream":true,"sampling_params":{"max_new_tokens":3}}`, ""},
		{`{"text":"a b c","sampling_params":{"max_new_tokens":3}}`, ""},
		{`{"text":"a b c","stream":true,"sampling_params":{"max_new_tokens":3}}`, "Connection: close\r\n"},
	} {
		fmt.Fprintf(c, "POST /generate HTTP/1.1\r\nHost: r\r\n%sContent-Length: %d\r\n\r\n%s", req.header, len(req.body), req.body)
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		b, err := io.ReadAll(resp.Body)
		stream := strings.Contains(req.body, `"stream":true`)
		if err != nil || resp.StatusCode != 200 || resp.Close != (req.header != "") ||
			stream && !strings.HasSuffix(string(b), "data: [DONE]\n\n") || !stream && !strings.Contains(string(b), `"text"`) {
			t.Fatalf("request %d: status %d, close %v, err %v: %q", i, resp.StatusCode, resp.Close, err, b)
		}
	}
	if n, err := br.Read(make([]byte, 1)); n != 0 || err != io.EOF {
		t.Errorf("after Connection: close: %d bytes, %v; want the connection closed", n, err)
	}
}

// An HTTP/1.0 client, which cannot read chunks, gets the events as they
// are, ended by the connection's close.
func TestStreamToHTTP10ClientEndsWithTheConnection(t *testing.T) {
	base, _, _, _ := h2cPD(t, mockworker.Config{}, mockworker.Config{})
	c, err := net.Dial("tcp", strings.TrimPrefix(base, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	body := `{"text":"a b c","stream":true,"sampling_params":{"max_new_tokens":3}}`
	fmt.Fprintf(c, "POST /generate HTTP/1.0\r\nHost: r\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	all, err := io.ReadAll(c)
	head, rest, _ := strings.Cut(string(all), "\r\n\r\n")
	if err != nil || !strings.HasPrefix(head, "HTTP/1.1 200") || strings.Contains(strings.ToLower(head), "transfer-encoding") ||
		!strings.HasPrefix(rest, "data: ") || !strings.HasSuffix(rest, "data: [DONE]\n\n") {
		t.Fatalf("err %v: %q", err, all)
	}
}

// A streaming request that fails before its first byte is answered on its
// hijacked connection as before (a JSON error, retries spent), and counted
// in the HTTP metrics with that status.
func TestStreamFailingBeforeItsFirstByteIsAnswered(t *testing.T) {
	base, srv, _, d := h2cPD(t, mockworker.Config{}, mockworker.Config{})
	d.Close()
	resp, err := http.Post(base+"/generate", "application/json", strings.NewReader(`{"text":"x","stream":true}`))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode < 500 || !strings.Contains(string(b), `"error"`) {
		t.Fatalf("status %d: %q; want a 5xx JSON error", resp.StatusCode, b)
	}
	counted := srv.metrics.httpResponses.WithLabelValues(fmt.Sprint(resp.StatusCode), resp.Header.Get("X-SMG-Error-Code"))
	if got := counterValue(t, counted); got != 1 {
		t.Errorf("smg_http_responses_total for the %d = %v, want 1", resp.StatusCode, got)
	}
}

// openFDs counts this process's open descriptors.
func openFDs(t *testing.T) int {
	entries, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Skip("no /proc/self/fd")
	}
	return len(entries)
}

// Streams whose clients read them whole and streams whose clients leave
// midway leave no descriptor, goroutine or request behind on the
// hijacked path: each client connection closes once its client has.
func TestHijackedStreamsLeaveNoDescriptors(t *testing.T) {
	base, srv, _, d := h2cPD(t, mockworker.Config{}, mockworker.Config{TokenDelay: 5 * time.Millisecond})
	if _, err := streamTokens(context.Background(), base, 1); err != nil { // the engine connections are up
		t.Fatal(err)
	}
	http.DefaultClient.CloseIdleConnections()
	waitFor(t, func() bool { return srv.live.Load() == 0 })
	fds, goroutines := openFDs(t), routerGoroutines()
	for i := range 20 {
		c, err := net.Dial("tcp", strings.TrimPrefix(base, "http://"))
		if err != nil {
			t.Fatal(err)
		}
		body := `{"text":"a b c","stream":true,"sampling_params":{"max_new_tokens":40}}`
		fmt.Fprintf(c, "POST /generate HTTP/1.1\r\nHost: r\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
		c.SetReadDeadline(time.Now().Add(10 * time.Second))
		br := bufio.NewReader(c)
		want := "data: [DONE]"
		if i%2 == 0 { // leaves after its first event
			want = "data: "
		}
		for {
			line, err := br.ReadString('\n')
			if err != nil {
				t.Fatalf("stream %d before %q: %v", i, want, err)
			}
			if strings.HasPrefix(line, want) {
				break
			}
		}
		c.Close()
	}
	waitFor(t, func() bool { return srv.live.Load() == 0 })
	// The engine hears each reset after the router has ended the request.
	for deadline := time.Now().Add(5 * time.Second); d.Stats().ClientGone < 10 && time.Now().Before(deadline); {
		time.Sleep(5 * time.Millisecond)
	}
	if gone := d.Stats().ClientGone; gone < 10 {
		t.Errorf("the decode engine saw %d of the 10 clients leave", gone)
	}
	deadline := time.Now().Add(5 * time.Second)
	for (openFDs(t) > fds || routerGoroutines() > goroutines) && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if n, g := openFDs(t), routerGoroutines(); n > fds || g > goroutines {
		t.Errorf("%d descriptors and %d router goroutines after the streams, %d and %d before", n, g, fds, goroutines)
	}
}

// Prefill's input logprobs are merged into every event of an h2c PD stream
// whose relay waits between events holding no goroutine (its merger keeps
// its buffer across the waits).
func TestH2CStreamMergesLogprobsAcrossWaits(t *testing.T) {
	base, _, _, _ := h2cPD(t, mockworker.Config{}, mockworker.Config{Tokens: 4, TokenDelay: 20 * time.Millisecond})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, "POST", base+"/generate",
		strings.NewReader(`{"text":"one two three four five","return_logprob":true,"stream":true}`))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("status %d, err %v: %s", resp.StatusCode, err, body)
	}
	events := 0
	for _, line := range strings.Split(string(body), "\n") {
		ev, ok := strings.CutPrefix(line, "data: ")
		if !ok || ev == "[DONE]" {
			continue
		}
		var out struct {
			MetaInfo struct {
				InputTokenLogprobs []json.RawMessage `json:"input_token_logprobs"`
			} `json:"meta_info"`
		}
		if err := json.Unmarshal([]byte(ev), &out); err != nil {
			t.Fatalf("event is not JSON: %s", ev)
		}
		// prefill reports all 5 prompt tokens, decode only the last one.
		if n := len(out.MetaInfo.InputTokenLogprobs); n != 6 {
			t.Errorf("event %d has %d input logprobs, want 5+1: %s", events, n, ev)
		}
		events++
	}
	if events < 4 {
		t.Errorf("%d events, want one a token", events)
	}
}
