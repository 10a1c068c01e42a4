package main

import (
	"net"
	"strings"
	"testing"

	"github.com/valyala/fasthttp"
)

func serveVLLM(t *testing.T, role string) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	v, err := newVLLMStub(role, 3, "127.0.0.1", ln.Addr().(*net.TCPAddr).Port)
	if err != nil {
		t.Fatal(err)
	}
	srv := &fasthttp.Server{Handler: v.handle}
	go srv.Serve(ln) //nolint:errcheck // ends at Shutdown
	t.Cleanup(func() { _ = srv.Shutdown() })
	return "http://" + ln.Addr().String()
}

// The vLLM stubs answer only what each leg must send: the prefill a body
// asking for a remote decode (with its kv_transfer_params), the decode one
// carrying them.
func TestVLLMStub(t *testing.T) {
	p, d := serveVLLM(t, "vllm-prefill"), serveVLLM(t, "vllm-decode")
	for _, c := range []struct {
		url, body string
		status    int
		want      string
	}{
		{p, `{"prompt":"a","max_tokens":1,"stream":false,"kv_transfer_params":{"do_remote_decode":true}}`, 200, `"kv_transfer_params":{"do_remote_prefill":true`},
		{p, `{"prompt":"a"}`, 400, "do_remote_decode true"},
		{d, `{"prompt":"a","kv_transfer_params":{"do_remote_prefill":true}}`, 200, `"text":" tok0 tok1 tok2"`},
		{d, `{"prompt":"a","stream":true,"kv_transfer_params":{"do_remote_prefill":true}}`, 200, "data: [DONE]"},
		{d, `{"prompt":"a","kv_transfer_params":null}`, 400, "a prefill's kv_transfer_params"},
	} {
		resp := do(t, "POST", c.url+"/v1/completions", c.body)
		if resp.StatusCode() != c.status || !strings.Contains(string(resp.Body()), c.want) {
			t.Errorf("%s: %d %s, want %d with %q", c.body, resp.StatusCode(), resp.Body(), c.status, c.want)
		}
	}
	if resp := do(t, "GET", p+"/server_info", ""); resp.StatusCode() != 404 {
		t.Errorf("/server_info: %d, want 404 as vLLM", resp.StatusCode())
	}
	if _, err := newVLLMStub("vllm-other", 1, "h", 1); err == nil {
		t.Error("unknown role accepted")
	}
}
