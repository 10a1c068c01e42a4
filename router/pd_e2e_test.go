package router_test

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/pdrouter/pdrouter/mock/mockworker"
)

func TestPDBootstrapInjection(t *testing.T) {
	t.Parallel()
	p1, p2 := startWorker(t, "prefill"), startWorker(t, "prefill")
	d := startWorker(t, "decode", "--tokens", "3")
	r := pd(t, []worker{p1, p2}, []worker{d})

	// Unknown fields, key order, number spellings and a client-sent
	// bootstrap field must reach both legs as sent, the latter overwritten.
	body := `{"zzz_unknown":{"keep":[1,2.50,"x"]},"text":"hello world","bootstrap_room":"client-value","sampling_params":{"max_new_tokens":3,"custom_knob":1e2}}`
	seen := map[string]bool{}
	for range 2 { // round robin visits both prefills
		resp, out := post(t, r.url+"/generate", body)
		if resp.StatusCode != 200 {
			t.Fatalf("status %d: %s", resp.StatusCode, out)
		}
		decReq := d.requests(t)
		got := decReq[len(decReq)-1]
		room := string(got.BootstrapRoom)
		n, err := strconv.ParseUint(room, 10, 64)
		if err != nil || n >= 1<<63 {
			t.Fatalf("bootstrap_room %s is not an integer in [0, 2^63-1]", room)
		}
		if string(got.BootstrapHost) != `"127.0.0.1"` {
			t.Errorf("bootstrap_host = %s, want \"127.0.0.1\"", got.BootstrapHost)
		}
		// The reply does not wait for prefill's (design §2.5), so the prefill
		// leg may still be on its way to its worker.
		var pre mockworker.RecordedRequest
		var wantPort string
		for deadline := time.Now().Add(5 * time.Second); wantPort == ""; time.Sleep(5 * time.Millisecond) {
			for _, c := range []struct {
				w    worker
				port string
			}{{p1, "8998"}, {p2, "null"}} {
				if rs := c.w.requests(t); len(rs) > 0 && string(rs[len(rs)-1].BootstrapRoom) == room {
					pre, wantPort = rs[len(rs)-1], c.port
				}
			}
			if wantPort == "" && time.Now().After(deadline) {
				t.Fatalf("no prefill recorded room %s", room)
			}
		}
		seen[wantPort] = true
		if pre.Body != got.Body {
			t.Errorf("legs got different bodies:\nprefill %s\ndecode  %s", pre.Body, got.Body)
		}
		if string(got.BootstrapPort) != wantPort {
			t.Errorf("bootstrap_port = %s, want %s", got.BootstrapPort, wantPort)
		}
		wantPrefix := `{"zzz_unknown":{"keep":[1,2.50,"x"]},"text":"hello world","bootstrap_room":` + room +
			`,"sampling_params":{"max_new_tokens":3,"custom_knob":1e2},"bootstrap_host":"127.0.0.1","bootstrap_port":` + wantPort +
			`,"rid":"` + bodyRID(t, got.Body) + `"}` // the rid both legs share, for aborts
		if got.Body != wantPrefix {
			t.Errorf("body not spliced in place:\n got %s\nwant %s", got.Body, wantPrefix)
		}
		if got.Headers["content-type"] != "application/json" {
			t.Errorf("content-type upstream = %q", got.Headers["content-type"])
		}
	}
	if !seen["8998"] || !seen["null"] {
		t.Errorf("expected both prefills (port and none), saw %v", seen)
	}
}

func TestPDBatchesGetOneRoomPerElement(t *testing.T) {
	t.Parallel()
	p, d := startWorker(t, "prefill"), startWorker(t, "decode", "--tokens", "2")
	r := pd(t, []worker{p}, []worker{d})
	for _, c := range []struct {
		path, body string
		n          int
	}{
		{"/generate", `{"input_ids":[[1,2,3],[4,5],[6]]}`, 3},
		{"/generate", `{"text":["a b","c"]}`, 2},
		{"/v1/chat/completions", `{"model":"mock","n":3,"messages":[{"role":"user","content":"hi"}]}`, 3},
		{"/v1/completions", `{"model":"mock","prompt":["x","y"]}`, 2},
		{"/v1/completions", `{"model":"mock","prompt":[1,2,3]}`, 1}, // one tokenized prompt
		{"/v1/rerank", `{"query":"q","documents":["a","b"]}`, 1},    // never a batch
	} {
		resp, out := post(t, r.url+c.path, c.body)
		if resp.StatusCode != 200 {
			t.Fatalf("%s %s: status %d: %s", c.path, c.body, resp.StatusCode, out)
		}
		reqs := d.requests(t)
		got := reqs[len(reqs)-1]
		if c.n == 1 {
			if _, err := strconv.ParseUint(string(got.BootstrapRoom), 10, 64); err != nil {
				t.Errorf("%s: room %s should be a scalar", c.body, got.BootstrapRoom)
			}
			continue
		}
		var rooms []uint64
		var hosts []string
		var ports []*int
		if json.Unmarshal(got.BootstrapRoom, &rooms) != nil || json.Unmarshal(got.BootstrapHost, &hosts) != nil ||
			json.Unmarshal(got.BootstrapPort, &ports) != nil {
			t.Fatalf("%s: bootstrap fields not arrays: %s %s %s", c.body, got.BootstrapHost, got.BootstrapPort, got.BootstrapRoom)
		}
		distinct := map[uint64]bool{}
		for _, rm := range rooms {
			distinct[rm] = true
		}
		if len(rooms) != c.n || len(hosts) != c.n || len(ports) != c.n || len(distinct) != c.n {
			t.Errorf("%s: want %d distinct rooms, got rooms %v hosts %v", c.body, c.n, rooms, hosts)
		}
		if *ports[0] != 8998 {
			t.Errorf("%s: port %d", c.body, *ports[0])
		}
	}
}

// A stream's first token does not wait for prefill's reply (design §2.5):
// with a prefill that answers its head at once but its body after 2 s, as
// SGLang's does, the client's first event comes from decode right away.
func TestPDStreamsBeforeSlowPrefillFinishes(t *testing.T) {
	t.Parallel()
	p := startWorker(t, "prefill", "--prefill-delay", "2s")
	d := startWorker(t, "decode", "--tokens", "4")
	r := pd(t, []worker{p}, []worker{d})
	start := time.Now()
	resp, err := client.Post(r.url+"/v1/chat/completions", "application/json",
		strings.NewReader(`{"model":"mock","stream":true,"messages":[{"role":"user","content":"hi"}]}`))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	br := bufio.NewReader(resp.Body)
	line, err := br.ReadString('\n')
	if err != nil {
		t.Fatal(err)
	}
	first := time.Since(start)
	if !strings.HasPrefix(line, "data: ") {
		t.Fatalf("first line %q", line)
	}
	if first > time.Second {
		t.Errorf("first chunk after %v: the router waited for prefill's 2 s body", first)
	}
	if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "text/event-stream") {
		t.Errorf("content type %q", ct)
	}
	rest, _ := io.ReadAll(br)
	if !strings.Contains(string(rest), "data: [DONE]") {
		t.Errorf("stream did not finish: %s", rest)
	}
}

func TestPDPrefillErrorCancelsDecode(t *testing.T) {
	t.Parallel()
	p := startWorker(t, "prefill", "--status-code", "400")
	d := startWorker(t, "decode", "--prefill-delay", "20s")
	r := pd(t, []worker{p}, []worker{d}, "--disable-retries")
	for _, stream := range []bool{false, true} {
		before := d.stats(t).ClientGone
		start := time.Now()
		resp, body := post(t, r.url+"/generate", `{"text":"hi","stream":`+strconv.FormatBool(stream)+`}`)
		if took := time.Since(start); took > time.Second {
			t.Errorf("stream=%v: prefill's error took %v to reach the client", stream, took)
		}
		if resp.StatusCode != 400 || resp.Header.Get("X-SMG-Error-Code") != "prefill_bad_request" {
			t.Fatalf("stream=%v: status %d code %q: %s", stream, resp.StatusCode, resp.Header.Get("X-SMG-Error-Code"), body)
		}
		// Nothing was streamed yet: a JSON error, for streams too (sglang-router sends SSE).
		if ct := resp.Header.Get("Content-Type"); ct != "application/json" {
			t.Errorf("stream=%v: Content-Type %q, want application/json", stream, ct)
		}
		if e := decodeError(t, body); !strings.Contains(e.Error.Message, "Prefill server error (400)") {
			t.Errorf("message %q", e.Error.Message)
		}
		// Decode was cancelled, or never reached when prefill failed first.
		d.waitStats(t, 3*time.Second, "decode leg cancelled", func(s mockworker.Stats) bool {
			return s.InFlight == 0 && s.Completed == 0 && s.ClientGone >= before
		})
	}
}

func TestPDDecodeErrors(t *testing.T) {
	t.Parallel()
	p := startWorker(t, "prefill")
	bad := startWorker(t, "decode", "--status-code", "500")
	r := pd(t, []worker{p}, []worker{bad}, "--disable-retries")
	resp, body := post(t, r.url+"/v1/completions", `{"model":"mock","prompt":"x"}`)
	if resp.StatusCode != 500 || decodeError(t, body).Error.Code != "decode_internal_error" {
		t.Errorf("status %d body %s", resp.StatusCode, body)
	}
	resp, body = post(t, r.url+"/v1/completions", `{"model":"mock","prompt":"x","stream":true}`)
	if resp.StatusCode != 500 || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		t.Errorf("stream: status %d type %q", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	if evs := sseEvents(body); len(evs) != 1 || !json.Valid([]byte(evs[0])) {
		t.Errorf("stream error is not one valid SSE JSON event: %q", body)
	}

	// A decode that fails twice then recovers: retries hide it.
	flaky := startWorker(t, "decode", "--fail-first-n", "2")
	r2 := pd(t, []worker{p}, []worker{flaky}, "--retry-initial-backoff-ms", "5")
	resp, body = post(t, r2.url+"/generate", `{"text":"retry me"}`)
	if resp.StatusCode != 200 {
		t.Fatalf("after retries: status %d: %s", resp.StatusCode, body)
	}
	reqs := flaky.requests(t)
	if len(reqs) != 3 {
		t.Fatalf("decode saw %d attempts, want 3", len(reqs))
	}
	if string(reqs[0].BootstrapRoom) == string(reqs[2].BootstrapRoom) {
		t.Errorf("retry reused room %s", reqs[0].BootstrapRoom)
	}
}

func TestPDClientDisconnectCancelsBothLegs(t *testing.T) {
	t.Parallel()
	p := startWorker(t, "prefill", "--prefill-delay", "20s")
	d := startWorker(t, "decode", "--prefill-delay", "20s")
	r := pd(t, []worker{p}, []worker{d})
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, "POST", r.url+"/generate", strings.NewReader(`{"text":"bye"}`))
	if _, err := http.DefaultClient.Do(req); err == nil {
		t.Fatal("request should have been cut by the client")
	}
	p.waitStats(t, 3*time.Second, "prefill cancelled", func(s mockworker.Stats) bool { return s.ClientGone == 1 })
	d.waitStats(t, 3*time.Second, "decode cancelled", func(s mockworker.Stats) bool { return s.ClientGone == 1 })

	// Mid-stream: the client reads one chunk and leaves.
	slow := startWorker(t, "decode", "--tokens", "200", "--token-delay", "50ms")
	fast := startWorker(t, "prefill")
	r2 := pd(t, []worker{fast}, []worker{slow})
	resp, err := client.Post(r2.url+"/v1/chat/completions", "application/json",
		strings.NewReader(`{"model":"mock","stream":true,"messages":[{"role":"user","content":"hi"}]}`))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := bufio.NewReader(resp.Body).ReadString('\n'); err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	slow.waitStats(t, 3*time.Second, "decode stream cancelled", func(s mockworker.Stats) bool { return s.ClientGone == 1 })
}

func TestPDLogprobsMerged(t *testing.T) {
	t.Parallel()
	p, d := startWorker(t, "prefill"), startWorker(t, "decode", "--tokens", "3")
	r := pd(t, []worker{p}, []worker{d})
	prompt := "one two three four five"
	resp, body := post(t, r.url+"/generate", `{"text":"`+prompt+`","return_logprob":true}`)
	if resp.StatusCode != 200 || !strings.HasPrefix(resp.Header.Get("Content-Type"), "application/json") {
		t.Fatalf("status %d type %q", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	var out struct {
		MetaInfo struct {
			InputTokenLogprobs []json.RawMessage `json:"input_token_logprobs"`
		} `json:"meta_info"`
	}
	if err := json.Unmarshal(body, &out); err != nil {
		t.Fatal(err)
	}
	// prefill reports all 5 prompt tokens, decode only the last one.
	if n := len(out.MetaInfo.InputTokenLogprobs); n != 6 {
		t.Errorf("merged input_token_logprobs has %d entries, want 5+1: %s", n, body)
	}

	resp, body = post(t, r.url+"/generate", `{"text":"`+prompt+`","return_logprob":true,"stream":true}`)
	if resp.StatusCode != 200 {
		t.Fatalf("stream status %d", resp.StatusCode)
	}
	merged := 0
	for _, ev := range sseEvents(body) {
		if ev == "[DONE]" {
			continue
		}
		if err := json.Unmarshal([]byte(ev), &out); err != nil {
			t.Fatalf("event is not JSON: %s", ev)
		}
		if n := len(out.MetaInfo.InputTokenLogprobs); n != 6 {
			t.Errorf("streamed event has %d input logprobs, want 6", n)
		}
		merged++
	}
	if merged == 0 {
		t.Error("no events")
	}
}

// bodyRID is the rid field of a JSON body.
func bodyRID(t *testing.T, body string) string {
	t.Helper()
	var v struct {
		RID string `json:"rid"`
	}
	if err := json.Unmarshal([]byte(body), &v); err != nil || len(v.RID) != 32 {
		t.Fatalf("no 32-hex rid in %s (%v)", body, err)
	}
	return v.RID
}

// A non-streamed request reads prefill's reply on the handler's goroutine
// only while prefill answers within prefillQuickAnswer: a prefill silent
// longer is watched beside decode, so decode's reply is not held for it,
// and its failure still cancels a decode that waits for its KV.
func TestPDSlowPrefillNonStreamed(t *testing.T) {
	t.Parallel()
	slow := startWorker(t, "prefill", "--prefill-delay", "3s")
	d := startWorker(t, "decode", "--tokens", "4")
	r := pd(t, []worker{slow}, []worker{d})
	start := time.Now()
	resp, body := post(t, r.url+"/generate", `{"text":"hi"}`)
	if took := time.Since(start); resp.StatusCode != 200 || took > 2*time.Second {
		t.Fatalf("status %d after %v (decode answers at once, prefill after 3 s): %s", resp.StatusCode, took, body)
	}

	failing := startWorker(t, "prefill", "--prefill-delay", "600ms", "--status-code", "400")
	waiting := startWorker(t, "decode", "--prefill-delay", "20s")
	r = pd(t, []worker{failing}, []worker{waiting}, "--disable-retries")
	start = time.Now()
	resp, body = post(t, r.url+"/generate", `{"text":"hi"}`)
	if took := time.Since(start); took > 5*time.Second {
		t.Errorf("prefill's error after 600 ms took %v to reach the client", took)
	}
	if resp.StatusCode != 400 || resp.Header.Get("X-SMG-Error-Code") != "prefill_bad_request" {
		t.Fatalf("status %d code %q: %s", resp.StatusCode, resp.Header.Get("X-SMG-Error-Code"), body)
	}
	waiting.waitStats(t, 3*time.Second, "decode leg cancelled", func(s mockworker.Stats) bool {
		return s.InFlight == 0 && s.Completed == 0 && s.ClientGone == 1
	})
}
