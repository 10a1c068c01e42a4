package main

import (
	"bytes"
	"fmt"
	"strings"
	"sync"

	"github.com/valyala/fasthttp"
)

// vllmStub is a lean stand-in for a vLLM server with a KV connector, for
// make bench-vllm's requests/s rows (--role vllm-prefill|vllm-decode). It
// serves POST /v1/completions with fixed OpenAI replies: the prefill's
// carries NIXL's kv_transfer_params and is answered only to a body asking
// for a remote decode; the decode answers only a body carrying a prefill's
// params (400 otherwise, so a bench proves the router relayed them), as
// one JSON reply or an SSE stream. /health and /v1/models as vLLM; no KV
// moves.
type vllmStub struct {
	prefill bool
	reply   []byte
	stream  []byte
	refused []byte
	models  []byte
	streams sync.Pool // of *sseBody
}

func newVLLMStub(role string, tokens int, host string, port int) (*vllmStub, error) {
	v := &vllmStub{prefill: role == "vllm-prefill"}
	if !v.prefill && role != "vllm-decode" {
		return nil, fmt.Errorf("--role %q: want vllm-prefill or vllm-decode", role)
	}
	if tokens < 1 {
		return nil, fmt.Errorf("--tokens %d: want at least 1", tokens)
	}
	v.streams.New = func() any { return &sseBody{pool: &v.streams} }
	var text strings.Builder
	for i := range tokens {
		fmt.Fprintf(&text, " tok%d", i)
	}
	params := ""
	if v.prefill {
		params = fmt.Sprintf(`,"kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[1],`+
			`"remote_engine_id":"stub","remote_request_id":"cmpl-stub","remote_host":%q,"remote_port":%d,"tp_size":1}`, host, port)
	}
	v.reply = fmt.Appendf(nil, `{"id":"cmpl-stub","object":"text_completion","created":0,"model":"mock","choices":[{"index":0,`+
		`"text":%q,"logprobs":null,"finish_reason":"length"}],"usage":{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}%s}`,
		text.String(), promptTokens, tokens, promptTokens+tokens, params)
	var sse bytes.Buffer
	for i := range tokens {
		fmt.Fprintf(&sse, `data: {"id":"cmpl-stub","object":"text_completion","created":0,"model":"mock","choices":[{"index":0,"text":" tok%d","logprobs":null,"finish_reason":null}]}`+"\n\n", i)
	}
	sse.WriteString(`data: {"id":"cmpl-stub","object":"text_completion","created":0,"model":"mock","choices":[{"index":0,"text":"","logprobs":null,"finish_reason":"length"}]}` + "\n\ndata: [DONE]\n\n")
	v.stream = sse.Bytes()
	want := "do_remote_decode true"
	if !v.prefill {
		want = "a prefill's kv_transfer_params"
	}
	v.refused = []byte(`{"object":"error","message":"` + role + ` stub needs ` + want + `","type":"BadRequestError","param":null,"code":400}`)
	v.models = []byte(`{"object":"list","data":[{"id":"mock","object":"model","created":0,"owned_by":"vllm","root":"mock"}]}`)
	return v, nil
}

var (
	remoteDecodeKey  = []byte(`"do_remote_decode"`)
	remotePrefillKey = []byte(`"do_remote_prefill"`)
)

func (v *vllmStub) handle(ctx *fasthttp.RequestCtx) {
	switch string(ctx.Path()) {
	case "/health":
	case "/v1/models":
		reply(ctx, v.models)
	case "/v1/completions":
		body := ctx.PostBody()
		asked := isTrue(body, remoteDecodeKey)
		if !v.prefill {
			asked = isTrue(body, remotePrefillKey)
		}
		switch {
		case !ctx.IsPost():
			ctx.Error("method not allowed", fasthttp.StatusMethodNotAllowed)
		case !asked:
			ctx.SetStatusCode(fasthttp.StatusBadRequest)
			reply(ctx, v.refused)
		case !v.prefill && isTrue(body, streamKey):
			ctx.SetContentType("text/event-stream")
			b := v.streams.Get().(*sseBody)
			b.rest = v.stream
			ctx.Response.SetBodyStream(b, -1)
		default:
			reply(ctx, v.reply)
		}
	default:
		ctx.Error("not found", fasthttp.StatusNotFound)
	}
}
