package router

import (
	"bytes"
	"net"
	"testing"

	"github.com/valyala/fasthttp"

	"github.com/pdrouter/pdrouter/balancer"
)

// cannedVLLM answers /v1/completions at once with reply (a vLLM prefill's
// or decode's) when the body contains want, and 400 otherwise: the
// router's own cost in vLLM mode, with proof that the legs got their fields.
func cannedVLLM(tb testing.TB, want, reply string) string {
	tb.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	wantBytes := []byte(want)
	srv := &fasthttp.Server{Handler: func(ctx *fasthttp.RequestCtx) {
		switch {
		case string(ctx.Path()) != "/v1/completions": // registration's probes: 200
		case !bytes.Contains(ctx.PostBody(), wantBytes):
			ctx.SetStatusCode(fasthttp.StatusBadRequest)
		default:
			ctx.SetContentType("application/json")
			ctx.SetBodyString(reply)
		}
	}}
	go srv.Serve(ln) //nolint:errcheck // ends at Shutdown
	tb.Cleanup(func() { _ = srv.Shutdown() })
	return "http://" + ln.Addr().String()
}

// cannedVLLMParams are NIXL's kv_transfer_params in a prefill's reply, as
// long as vLLM's (more than splice.Body's inline space).
const cannedVLLMParams = `{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[1,2,3,4],` +
	`"remote_engine_id":"9f1c0c2e-5a7b-4d3e-8f60-2b1a7c9d4e11","remote_request_id":"cmpl-___prefill_addr_10.0.0.1:8100-0",` +
	`"remote_host":"10.0.0.1","remote_port":5600,"tp_size":1}`

// cannedVLLMConfig is a vLLM PD router on a canned prefill, whose reply
// carries cannedVLLMParams, and a canned decode that answers only a body
// carrying them.
func cannedVLLMConfig(tb testing.TB) Config {
	cfg := DefaultConfig()
	cfg.PDDisaggregation, cfg.VLLMPDDisaggregation = true, true
	cfg.Prefill = []PrefillSpec{{URL: cannedVLLM(tb, `"do_remote_decode":true`, `{"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":" tok1",`+
		`"finish_reason":"length"}],"kv_transfer_params":`+cannedVLLMParams+`}`),
		BootstrapPort: balancer.NoBootstrapPort}}
	cfg.Decode = []string{cannedVLLM(tb, `"kv_transfer_params":`+cannedVLLMParams,
		`{"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":" tok1 tok2 tok3 tok4","finish_reason":"length"}]}`)}
	return cfg
}

var cannedVLLMRequest = []byte(`{"model":"mock","prompt":"The quick brown fox jumps over the lazy dog","max_tokens":4}`)

// BenchmarkVLLM is a non-streamed vLLM PD request: compare with
// BenchmarkPD's SGLang request in the same run (two legs each).
func BenchmarkVLLM(b *testing.B) {
	base, srv := serveInProcess(b, cannedVLLMConfig(b))
	benchPosts(b, srv, base+"/v1/completions", cannedVLLMRequest)
}
