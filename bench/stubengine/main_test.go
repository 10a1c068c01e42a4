package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"io"
	"net"
	"strconv"
	"strings"
	"testing"

	"github.com/valyala/fasthttp"
)

// serve runs a stub of role on a loopback port and returns its address.
func serve(t *testing.T, role string, tokens int) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s, err := newStub(role, tokens, "127.0.0.1", ln.Addr().(*net.TCPAddr).Port)
	if err != nil {
		t.Fatal(err)
	}
	srv := &fasthttp.Server{Handler: s.handle}
	go srv.Serve(ln) //nolint:errcheck // ends at Shutdown
	t.Cleanup(func() { _ = srv.Shutdown() })
	return ln.Addr().String()
}

func do(t *testing.T, method, url, body string) *fasthttp.Response {
	t.Helper()
	req, resp := fasthttp.AcquireRequest(), &fasthttp.Response{}
	defer fasthttp.ReleaseRequest(req)
	req.SetRequestURI(url)
	req.Header.SetMethod(method)
	req.SetBodyString(body)
	if err := fasthttp.Do(req, resp); err != nil {
		t.Fatal(err)
	}
	return resp
}

type genReply struct {
	Text      string `json:"text"`
	OutputIDs []int  `json:"output_ids"`
	MetaInfo  struct {
		ID           string `json:"id"`
		FinishReason *struct {
			Type   string `json:"type"`
			Length int    `json:"length"`
		} `json:"finish_reason"`
		PromptTokens     int `json:"prompt_tokens"`
		CompletionTokens int `json:"completion_tokens"`
	} `json:"meta_info"`
}

// checkFinal asserts a finished reply of n tokens.
func checkFinal(t *testing.T, g genReply, n int) {
	t.Helper()
	if g.MetaInfo.CompletionTokens != n || len(g.OutputIDs) != n || len(strings.Fields(g.Text)) != n {
		t.Fatalf("want %d tokens, got completion_tokens %d, %d ids, text %q", n, g.MetaInfo.CompletionTokens, len(g.OutputIDs), g.Text)
	}
	if f := g.MetaInfo.FinishReason; f == nil || f.Type != "length" || f.Length != n {
		t.Fatalf("finish_reason %+v, want length %d", f, n)
	}
	if g.MetaInfo.ID == "" || g.MetaInfo.PromptTokens <= 0 {
		t.Fatalf("meta_info id %q prompt_tokens %d", g.MetaInfo.ID, g.MetaInfo.PromptTokens)
	}
}

const boot = `"bootstrap_host":"127.0.0.1","bootstrap_port":8998,"bootstrap_room":7`

func TestGenerateShapes(t *testing.T) {
	for _, tc := range []struct {
		role string
		body string
		want int
	}{
		{"regular", `{"text":"a b","stream":false}`, 5},
		{"regular", `{"text":"a b"}`, 5},
		{"decode", `{"text":"a b",` + boot + `}`, 5},
		{"prefill", `{"text":"a b",` + boot + `}`, 1}, // SGLang's prefill answers one token
	} {
		addr := serve(t, tc.role, 5)
		resp := do(t, "POST", "http://"+addr+"/generate", tc.body)
		if resp.StatusCode() != 200 || string(resp.Header.ContentType()) != "application/json" {
			t.Fatalf("%s: %d %q %s", tc.role, resp.StatusCode(), resp.Header.ContentType(), resp.Body())
		}
		var g genReply
		if err := json.Unmarshal(resp.Body(), &g); err != nil {
			t.Fatalf("%s: %v in %s", tc.role, err, resp.Body())
		}
		checkFinal(t, g, tc.want)
	}
}

func TestStreamFraming(t *testing.T) {
	for _, tc := range []struct {
		role, body string
		want       int
	}{
		{"regular", `{"text":"a","stream": true}`, 4},
		{"decode", "{\"stream\"\n:\ttrue," + boot + `}`, 4},
		{"prefill", `{"stream":true,` + boot + `}`, 1},
	} {
		addr := serve(t, tc.role, 4)
		resp := do(t, "POST", "http://"+addr+"/generate", tc.body)
		if resp.StatusCode() != 200 || string(resp.Header.ContentType()) != "text/event-stream" {
			t.Fatalf("%s: %d %q", tc.role, resp.StatusCode(), resp.Header.ContentType())
		}
		if resp.Header.ContentLength() != -1 {
			t.Fatalf("%s: Content-Length %d, want a chunked body as SGLang sends", tc.role, resp.Header.ContentLength())
		}
		body := string(resp.Body())
		if !strings.HasSuffix(body, "data: [DONE]\n\n") {
			t.Fatalf("%s: stream does not end in [DONE]: %q", tc.role, body)
		}
		events := strings.Split(strings.TrimSuffix(body, "\n\n"), "\n\n")
		if len(events) != tc.want+1 {
			t.Fatalf("%s: %d events, want %d and [DONE]: %q", tc.role, len(events)-1, tc.want, body)
		}
		prev := ""
		for k, ev := range events[:tc.want] {
			payload, ok := strings.CutPrefix(ev, "data: ")
			if !ok {
				t.Fatalf("%s: event %d %q lacks data: ", tc.role, k, ev)
			}
			var g genReply
			if err := json.Unmarshal([]byte(payload), &g); err != nil {
				t.Fatalf("%s: event %d: %v", tc.role, k, err)
			}
			// SGLang's default stream carries the cumulative text.
			if g.MetaInfo.CompletionTokens != k+1 || !strings.HasPrefix(g.Text, prev) || len(g.Text) <= len(prev) {
				t.Fatalf("%s: event %d: completion_tokens %d text %q after %q", tc.role, k, g.MetaInfo.CompletionTokens, g.Text, prev)
			}
			prev = g.Text
			if k < tc.want-1 && g.MetaInfo.FinishReason != nil {
				t.Fatalf("%s: event %d finished early", tc.role, k)
			}
			if k == tc.want-1 {
				checkFinal(t, g, tc.want)
			}
		}
	}
}

// The stream goes out at once: one HTTP chunk holding every event, then the
// last chunk, nothing paced.
func TestStreamIsOneChunk(t *testing.T) {
	addr := serve(t, "regular", 8)
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Write([]byte("POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 15\r\n\r\n{\"stream\":true}")); err != nil {
		t.Fatal(err)
	}
	r := bufio.NewReader(c)
	for { // the head
		line, err := r.ReadString('\n')
		if err != nil {
			t.Fatal(err)
		}
		if line == "\r\n" {
			break
		}
	}
	var sizes []int64
	for {
		line, err := r.ReadString('\n')
		if err != nil {
			t.Fatal(err)
		}
		n, err := strconv.ParseInt(strings.TrimSpace(line), 16, 64)
		if err != nil {
			t.Fatalf("chunk size line %q: %v", line, err)
		}
		sizes = append(sizes, n)
		if n == 0 {
			break
		}
		chunk := make([]byte, n+2)
		if _, err := io.ReadFull(r, chunk); err != nil {
			t.Fatal(err)
		}
		if got := bytes.Count(chunk, []byte("data: ")); got != 9 {
			t.Fatalf("chunk holds %d events, want 8 and [DONE]", got)
		}
	}
	if len(sizes) != 2 {
		t.Fatalf("chunk sizes %v, want one chunk and the last", sizes)
	}
}

func TestPDRolesNeedBootstrapFields(t *testing.T) {
	for _, role := range []string{"prefill", "decode"} {
		addr := serve(t, role, 8)
		for _, body := range []string{
			`{"text":"a"}`,
			`{"text":"a","bootstrap_host":"127.0.0.1"}`,
			`{"text":"a","bootstrap_room":1}`,
			`{"text":"a","bootstrap_host":"127.0.0.1","bootstrap_room":null}`,
			`{"text":"a \"bootstrap_host\":\"h\",\"bootstrap_room\":1","stream":true}`, // inside a string: not fields
		} {
			resp := do(t, "POST", "http://"+addr+"/generate", body)
			var e struct {
				Object  string `json:"object"`
				Message string `json:"message"`
				Type    string `json:"type"`
				Code    int    `json:"code"`
			}
			if resp.StatusCode() != 400 {
				t.Fatalf("%s %s: %d, want 400", role, body, resp.StatusCode())
			}
			if err := json.Unmarshal(resp.Body(), &e); err != nil || e.Object != "error" || e.Code != 400 ||
				e.Type != "BadRequestError" || !strings.Contains(e.Message, "bootstrap_room") {
				t.Fatalf("%s %s: error body %s (%v)", role, body, resp.Body(), err)
			}
		}
		if resp := do(t, "POST", "http://"+addr+"/generate", `{"text":"a",`+boot+`}`); resp.StatusCode() != 200 {
			t.Fatalf("%s with bootstrap fields: %d %s", role, resp.StatusCode(), resp.Body())
		}
	}
	// A regular engine takes requests with or without them.
	addr := serve(t, "regular", 8)
	if resp := do(t, "POST", "http://"+addr+"/generate", `{"text":"a"}`); resp.StatusCode() != 200 {
		t.Fatalf("regular: %d", resp.StatusCode())
	}
}

func TestInfoEndpoints(t *testing.T) {
	for _, tc := range []struct{ role, mode string }{{"regular", "null"}, {"prefill", "prefill"}, {"decode", "decode"}} {
		addr := serve(t, tc.role, 8)
		for _, path := range []string{"/get_server_info", "/server_info"} {
			var info struct {
				Mode string `json:"disaggregation_mode"`
				Port int    `json:"disaggregation_bootstrap_port"`
				DP   int    `json:"dp_size"`
			}
			resp := do(t, "GET", "http://"+addr+path, "")
			if err := json.Unmarshal(resp.Body(), &info); err != nil || info.Mode != tc.mode || info.Port != bootstrapPort || info.DP != 1 {
				t.Fatalf("%s %s: %+v %v", tc.role, path, info, err)
			}
		}
		var models struct {
			Data []struct{ ID string } `json:"data"`
		}
		if err := json.Unmarshal(do(t, "GET", "http://"+addr+"/v1/models", "").Body(), &models); err != nil || len(models.Data) != 1 || models.Data[0].ID != "mock" {
			t.Fatalf("/v1/models: %+v %v", models, err)
		}
		var load []map[string]int
		if err := json.Unmarshal(do(t, "GET", "http://"+addr+"/get_load", "").Body(), &load); err != nil || len(load) != 1 {
			t.Fatalf("/get_load: %v %v", load, err)
		}
		if _, ok := load[0]["num_tokens"]; !ok {
			t.Fatalf("/get_load lacks num_tokens: %v", load)
		}
		var loads struct {
			Loads []map[string]any `json:"loads"`
		}
		if err := json.Unmarshal(do(t, "GET", "http://"+addr+"/v1/loads", "").Body(), &loads); err != nil || len(loads.Loads) != 1 {
			t.Fatalf("/v1/loads: %+v %v", loads, err)
		}
		for _, path := range []string{"/get_model_info", "/model_info"} {
			var mi map[string]any
			if err := json.Unmarshal(do(t, "GET", "http://"+addr+path, "").Body(), &mi); err != nil || mi["is_generation"] != true {
				t.Fatalf("%s: %v %v", path, mi, err)
			}
		}
		for _, c := range []struct {
			method, path string
			code         int
		}{
			{"GET", "/health", 200}, {"GET", "/health_generate", 200}, {"POST", "/flush_cache", 200},
			{"GET", "/flush_cache", 200}, {"POST", "/abort_request", 200}, {"GET", "/abort_request", 405},
			{"GET", "/generate", 405}, {"GET", "/nope", 404}, {"POST", "/v1/chat/completions", 404},
		} {
			if got := do(t, c.method, "http://"+addr+c.path, "").StatusCode(); got != c.code {
				t.Fatalf("%s %s %s: %d, want %d", tc.role, c.method, c.path, got, c.code)
			}
		}
	}
}

func TestBadFlags(t *testing.T) {
	if _, err := newStub("mixed", 8, "h", 1); err == nil {
		t.Fatal("unknown role accepted")
	}
	if _, err := newStub("decode", 0, "h", 1); err == nil {
		t.Fatal("--tokens 0 accepted")
	}
}

// The hot path allocates nothing once fasthttp's buffers and the stream pool
// are warm.
func TestGenerateAllocatesNothing(t *testing.T) {
	s, err := newStub("decode", 8, "127.0.0.1", 1)
	if err != nil {
		t.Fatal(err)
	}
	for _, body := range []string{`{"text":"a",` + boot + `}`, `{"text":"a","stream":true,` + boot + `}`} {
		var ctx fasthttp.RequestCtx
		ctx.Request.Header.SetMethod("POST")
		ctx.Request.SetRequestURI("/generate")
		ctx.Request.SetBodyString(body)
		run := func() {
			ctx.Response.Reset() // closes the stream body, as writing it would
			s.handle(&ctx)
		}
		run()
		if ctx.Response.StatusCode() != 200 {
			t.Fatalf("%s: %d", body, ctx.Response.StatusCode())
		}
		if n := testing.AllocsPerRun(200, run); n != 0 {
			t.Fatalf("%s: %.1f allocations per request", body, n)
		}
	}
}

func TestValueScan(t *testing.T) {
	for _, tc := range []struct {
		body   string
		stream bool
	}{
		{`{"stream":true}`, true},
		{`{"stream" : true}`, true},
		{`{"stream":false}`, false},
		{`{"stream_options":true}`, false},
		{`{"text":"\"stream\":true"}`, false},
		{`{"text":"stream","stream":true}`, true},
		{`{"stream"`, false},
		{``, false},
	} {
		if got := isTrue([]byte(tc.body), streamKey); got != tc.stream {
			t.Errorf("isTrue(%s) = %v", tc.body, got)
		}
	}
}
