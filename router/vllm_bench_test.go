package router

import (
	"net"
	"testing"

	"github.com/valyala/fasthttp"

	"github.com/pdrouter/pdrouter/balancer"
)

// cannedVLLM answers /v1/completions at once with reply (a vLLM prefill's
// or decode's), for the router's own cost in vLLM mode.
func cannedVLLM(b *testing.B, reply string) string {
	b.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	srv := &fasthttp.Server{Handler: func(ctx *fasthttp.RequestCtx) {
		if string(ctx.Path()) == "/v1/completions" {
			ctx.SetContentType("application/json")
			ctx.SetBodyString(reply)
		}
	}}
	go srv.Serve(ln) //nolint:errcheck // ends at Shutdown
	b.Cleanup(func() { _ = srv.Shutdown() })
	return "http://" + ln.Addr().String()
}

// BenchmarkVLLM is a non-streamed vLLM PD request: compare with
// BenchmarkPD's SGLang request in the same run (two legs each).
func BenchmarkVLLM(b *testing.B) {
	cfg := DefaultConfig()
	cfg.PDDisaggregation, cfg.VLLMPDDisaggregation = true, true
	cfg.Prefill = []PrefillSpec{{URL: cannedVLLM(b, `{"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":" tok1",`+
		`"finish_reason":"length"}],"kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[1,2],`+
		`"remote_engine_id":"e","remote_request_id":"cmpl-1","remote_host":"127.0.0.1","remote_port":5600,"tp_size":1}}`),
		BootstrapPort: balancer.NoBootstrapPort}}
	cfg.Decode = []string{cannedVLLM(b, `{"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":" tok1 tok2 tok3 tok4","finish_reason":"length"}]}`)}
	base, srv := serveInProcess(b, cfg)
	benchPosts(b, srv, base+"/v1/completions", []byte(`{"model":"mock","prompt":"The quick brown fox jumps over the lazy dog","max_tokens":4}`))
}
