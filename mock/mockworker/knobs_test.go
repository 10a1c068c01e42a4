package mockworker

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// waitFor polls cond for up to 5 s.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		if cond() {
			return
		}
	}
	t.Fatalf("timed out waiting for %s", what)
}

func TestFailFirstN(t *testing.T) {
	h := start(t, Config{FailFirstN: 2})
	for i, want := range []int{500, 500, 200, 200} {
		code, hdr, b := h.post("/v1/completions", `{"prompt":"x"}`)
		if code != want {
			t.Fatalf("request %d: %d %s", i, code, b)
		}
		if code == 500 {
			m := decodeObj(t, b)
			if m["object"] != "error" || num(t, m, "code") != 500 || m["type"] != "InternalServerError" || hdr.Get("X-Worker-Id") == "" {
				t.Errorf("error body %s", b)
			}
		}
	}
	if st := h.s.Stats(); st.Requests != 4 || st.Errors != 2 || st.Completed != 2 {
		t.Errorf("stats %+v", st)
	}
}

func TestStatusCode(t *testing.T) {
	h := start(t, Config{StatusCode: 503})
	for _, p := range []string{"/generate", "/v1/chat/completions"} {
		code, _, b := h.post(p, `{"text":"x","messages":[{"role":"user","content":"x"}],"stream":true}`)
		if m := decodeObj(t, b); code != 503 || num(t, m, "code") != 503 || m["type"] != "ServiceUnavailableError" {
			t.Errorf("%s: %d %s", p, code, b)
		}
	}
	if code, _ := h.get("/health"); code != 200 {
		t.Errorf("health follows its own knobs: %d", code)
	}
}

func TestRandomFailRateSeeded(t *testing.T) {
	outcomes := func() string {
		h := start(t, Config{RandomFailRate: 0.5, Seed: 42})
		var s strings.Builder
		for range 20 {
			code, _, _ := h.post("/generate", `{"text":"x"}`)
			s.WriteByte("01"[min(code/500, 1)])
		}
		return s.String()
	}
	a, b := outcomes(), outcomes()
	if a != b || !strings.Contains(a, "0") || !strings.Contains(a, "1") {
		t.Errorf("seeded outcomes %s vs %s", a, b)
	}
}

func TestHangCountsClientGone(t *testing.T) {
	h := start(t, Config{Hang: true})
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, h.s.URL()+"/generate", strings.NewReader(`{"text":"x"}`))
	errc := make(chan error, 1)
	go func() {
		resp, err := h.client.Do(req)
		if err == nil {
			resp.Body.Close()
		}
		errc <- err
	}()
	waitFor(t, "request in flight", func() bool { return h.s.Stats().InFlight == 1 })
	// The body is visible while the request hangs.
	if r := h.s.Requests(); len(r) != 1 || r[0].Body != `{"text":"x"}` || r[0].Finished != "" {
		t.Errorf("in-flight record %+v", r)
	}
	select {
	case err := <-errc:
		t.Fatalf("hang answered: %v", err)
	case <-time.After(50 * time.Millisecond):
	}
	cancel()
	if err := <-errc; !errors.Is(err, context.Canceled) {
		t.Errorf("client error %v", err)
	}
	waitFor(t, "client_gone", func() bool { return h.s.Stats().ClientGone == 1 })
	if st := h.s.Stats(); st.InFlight != 0 || st.Completed != 0 || st.Errors != 0 {
		t.Errorf("stats %+v", st)
	}
	if r := h.s.Requests(); r[0].Finished != FinishedClientGone || r[0].FinishedUnixNano < r[0].StartedUnixNano {
		t.Errorf("record %+v", r[0])
	}
}

func TestCloseEndsHangingRequests(t *testing.T) {
	s, err := Start(Config{Hang: true})
	if err != nil {
		t.Fatal(err)
	}
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	done := make(chan struct{})
	go func() {
		defer close(done)
		resp, err := (&http.Client{Transport: tr}).Post(s.URL()+"/generate", "", strings.NewReader(`{"text":"x"}`))
		if err == nil {
			resp.Body.Close()
		}
	}()
	waitFor(t, "in flight", func() bool { return s.Stats().InFlight == 1 })
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	<-done
	if st := s.Stats(); st.ClientGone != 1 || st.InFlight != 0 {
		t.Errorf("stats %+v", st)
	}
}

func TestPrefillDelay(t *testing.T) {
	const d = 150 * time.Millisecond
	h := start(t, Config{PrefillDelay: d, Tokens: 2})
	t0 := time.Now()
	resp := h.do(http.MethodPost, "/generate", `{"text":"x"}`)
	resp.Body.Close()
	if el := time.Since(t0); el < d {
		t.Errorf("non-stream answer after %v, want >= %v", el, d)
	}
	// A stream's head comes at once (as SGLang's), its first event after d.
	t0 = time.Now()
	resp = h.do(http.MethodPost, "/generate", `{"text":"x","stream":true}`)
	defer resp.Body.Close()
	if el := time.Since(t0); resp.StatusCode != 200 || el >= d {
		t.Errorf("stream head %d after %v, want 200 before %v", resp.StatusCode, el, d)
	}
	ev := readEvents(resp.Body)
	<-ev
	if el := time.Since(t0); el < d {
		t.Errorf("first event after %v, want >= %v", el, d)
	}
	for range ev {
	}
	// A client leaving during the prefill delay is client_gone.
	ctx, cancel := context.WithTimeout(context.Background(), d/3)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, h.s.URL()+"/generate", strings.NewReader(`{"text":"x"}`))
	if _, err := h.client.Do(req); err == nil {
		t.Fatal("expected timeout")
	}
	waitFor(t, "client_gone", func() bool { return h.s.Stats().ClientGone == 1 })
}

func TestTokenDelayPacing(t *testing.T) {
	const d = 40 * time.Millisecond
	h := start(t, Config{TokenDelay: d, Tokens: 5})
	t0 := time.Now()
	resp := h.do(http.MethodPost, "/v1/completions", `{"prompt":"x","stream":true}`)
	defer resp.Body.Close()
	var at []time.Duration
	for p := range readEvents(resp.Body) {
		if strings.Contains(p, `"text":" tok`) {
			at = append(at, time.Since(t0))
		}
	}
	if len(at) != 5 {
		t.Fatalf("%d token chunks", len(at))
	}
	// Token k arrives k delays after the first, no earlier.
	for k := 1; k < 5; k++ {
		if gap := at[k] - at[0]; gap < time.Duration(k)*d-5*time.Millisecond {
			t.Errorf("token %d after %v, want >= %v", k, gap, time.Duration(k)*d)
		}
	}
	// Non-streaming takes the same total time.
	t0 = time.Now()
	h.postJSON("/v1/completions", `{"prompt":"x"}`)
	if el := time.Since(t0); el < 4*d {
		t.Errorf("non-stream took %v, want >= %v", el, 4*d)
	}
}

func TestStreamClientGone(t *testing.T) {
	h := start(t, Config{TokenDelay: 20 * time.Millisecond, Tokens: 1000})
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, h.s.URL()+"/v1/chat/completions", strings.NewReader(`{"messages":[{"role":"user","content":"x"}],"stream":true}`))
	resp, err := h.client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	ev := readEvents(resp.Body)
	<-ev
	<-ev
	cancel()
	resp.Body.Close()
	for range ev {
	}
	waitFor(t, "client_gone", func() bool { return h.s.Stats().ClientGone == 1 })
	if r := h.s.Requests(); r[0].Finished != FinishedClientGone || r[0].Status != 200 {
		t.Errorf("record %+v", r[0])
	}
}

func TestCrashOnRequest(t *testing.T) {
	var exits atomic.Int32
	h := start(t, Config{CrashOnRequest: true, Exit: func(code int) {
		if code == 1 {
			exits.Add(1)
		}
	}})
	req, _ := http.NewRequest(http.MethodPost, h.s.URL()+"/generate", strings.NewReader(`{"text":"x"}`))
	if resp, err := h.client.Do(req); err == nil {
		resp.Body.Close()
		t.Fatalf("crashed request answered %d", resp.StatusCode)
	}
	if exits.Load() != 1 {
		t.Fatalf("exit called %d times", exits.Load())
	}
	if code, _, _ := h.post("/generate", `{"text":"x"}`); code != 200 {
		t.Errorf("after the (hooked) crash: %d", code)
	}
}

func TestHealthKnobs(t *testing.T) {
	h := start(t, Config{HealthFailAfter: 300 * time.Millisecond})
	if code, _ := h.get("/health"); code != 200 {
		t.Errorf("before: %d", code)
	}
	time.Sleep(320 * time.Millisecond)
	for _, p := range []string{"/health", "/health_generate"} {
		if code, _ := h.get(p); code != 503 {
			t.Errorf("%s after: %d", p, code)
		}
	}
	f := start(t, Config{HealthFlap: 80 * time.Millisecond})
	seen := map[int]bool{}
	for deadline := time.Now().Add(400 * time.Millisecond); time.Now().Before(deadline) && len(seen) < 2; time.Sleep(10 * time.Millisecond) {
		code, _ := f.get("/health")
		seen[code] = true
	}
	if !seen[200] || !seen[503] {
		t.Errorf("flap saw %v", seen)
	}
}

func TestLoadAndMetricsTrackInFlight(t *testing.T) {
	h := start(t, Config{Hang: true})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, h.s.URL()+"/generate", strings.NewReader(`{"text":"a b c","sampling_params":{"max_new_tokens":2}}`))
		if resp, err := h.client.Do(req); err == nil {
			resp.Body.Close()
		}
	}()
	waitFor(t, "in flight", func() bool { return h.s.Stats().InFlight == 1 })
	// Hang parks requests before parsing, so only num_reqs is known.
	_, b := h.get("/get_load")
	if !strings.Contains(string(b), `"num_reqs":1`) || !strings.Contains(string(b), `"dp_rank":0`) || !strings.Contains(string(b), `"num_waiting_reqs":0`) {
		t.Errorf("get_load %s", b)
	}
	if _, b := h.get("/metrics"); !strings.Contains(string(b), "sglang:num_running_reqs{model_name=\"mock\"} 1\n") {
		t.Errorf("metrics %s", b)
	}
	cancel()
	waitFor(t, "drained", func() bool { return h.s.Stats().InFlight == 0 })

	d := start(t, Config{PrefillDelay: time.Hour})
	ctx2, cancel2 := context.WithCancel(context.Background())
	defer cancel2()
	go func() {
		req, _ := http.NewRequestWithContext(ctx2, http.MethodPost, d.s.URL()+"/generate", strings.NewReader(`{"text":"a b c","sampling_params":{"max_new_tokens":2}}`))
		if resp, err := d.client.Do(req); err == nil {
			resp.Body.Close()
		}
	}()
	waitFor(t, "tokens counted", func() bool {
		_, b := d.get("/get_load")
		return strings.Contains(string(b), `"num_tokens":5`)
	})
	cancel2()
	waitFor(t, "drained", func() bool {
		_, b := d.get("/get_load")
		return strings.Contains(string(b), `"num_tokens":0`) && d.s.Stats().InFlight == 0
	})
}

func TestPrefillDelayStreamFailsBeforeItsHead(t *testing.T) {
	const d = time.Hour // never waited: the failure comes first
	h := start(t, Config{PrefillDelay: d, FailFirstN: 1})
	resp := h.do(http.MethodPost, "/generate", `{"text":"x","stream":true}`)
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusInternalServerError || resp.Header.Get("Content-Type") != "application/json" {
		t.Fatalf("got %d %q, want a JSON 500 at once", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
}
