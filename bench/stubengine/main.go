// Command stubengine is a lean SGLang engine stand-in for make bench's
// throughput and fixed-rate latency rows: every answer is a body built once
// at start-up, so a request costs little more than fasthttp's own parsing and
// writing. mock/mockworker speaks far more of SGLang and has delay and
// failure knobs, but its net/http + encoding/json path costs several times a
// bare answer per request; on a box whose few cores the load generator,
// workers and router share, that cost, not the router's, sets the pace.
//
// It serves, in SGLang's shapes:
//
//	POST /generate      a fixed non-streamed reply of --tokens tokens (1 in the
//	                    prefill role, as SGLang's prefill answers), or with
//	                    "stream":true that many cumulative-text SSE events and
//	                    data: [DONE], written at once (zero delay). The request
//	                    is never parsed: prompt_tokens is fixed and
//	                    max_new_tokens is ignored. In the prefill and decode
//	                    roles a body without bootstrap_host and bootstrap_room
//	                    gets 400, so a bench proves the router injected them.
//	GET  /health, /health_generate, /get_server_info, /server_info,
//	     /get_model_info, /model_info, /v1/models, /get_load, /v1/loads
//	GET|POST /flush_cache, POST /abort_request
//
// Any other path answers 404 and is logged to stderr once, which shows what a
// router expects of a worker.
package main

import (
	"bytes"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"

	"github.com/valyala/fasthttp"
)

func main() {
	host := flag.String("host", "127.0.0.1", "address to serve on")
	port := flag.Int("port", 0, "port to serve on (0: any free port)")
	role := flag.String("role", "regular", "regular, prefill or decode (SGLang); vllm-prefill or vllm-decode (vLLM with a KV connector)")
	tokens := flag.Int("tokens", 8, "completion tokens per reply (prefill: always 1)")
	flag.Parse()
	ln, err := net.Listen("tcp", net.JoinHostPort(*host, strconv.Itoa(*port)))
	if err != nil {
		fmt.Fprintln(os.Stderr, "stubengine:", err)
		os.Exit(1)
	}
	addr := ln.Addr().(*net.TCPAddr)
	var handle fasthttp.RequestHandler
	if strings.HasPrefix(*role, "vllm-") { // vllm.go
		v, err := newVLLMStub(*role, *tokens, *host, addr.Port)
		if err != nil {
			fmt.Fprintln(os.Stderr, "stubengine:", err)
			os.Exit(2)
		}
		handle = v.handle
	} else {
		s, err := newStub(*role, *tokens, *host, addr.Port)
		if err != nil {
			fmt.Fprintln(os.Stderr, "stubengine:", err)
			os.Exit(2)
		}
		handle = s.handle
	}
	fmt.Printf("listening on %s\n", addr)
	srv := &fasthttp.Server{Handler: handle, Name: "stubengine", NoDefaultDate: true, Logger: probeFilter{}}
	if err := srv.Serve(ln); err != nil {
		fmt.Fprintln(os.Stderr, "stubengine:", err)
		os.Exit(1)
	}
}

// probeFilter logs fasthttp's connection errors except those for the HTTP/2
// prior-knowledge preface ("PRI * HTTP/2.0"), a probe that sglang-router and
// smg send each worker at start-up before going on over HTTP/1.1.
type probeFilter struct{}

func (probeFilter) Printf(format string, args ...any) {
	if msg := fmt.Sprintf(format, args...); !strings.Contains(msg, "PRI * HTTP/2.0") {
		fmt.Fprintln(os.Stderr, "stubengine:", msg)
	}
}

// bootstrapPort is what /server_info reports; SGLang's default.
const bootstrapPort = 8998

// promptTokens is the fixed prompt_tokens every reply reports (make bench's
// latency prompts are 16 words).
const promptTokens = 16

// stub holds every reply, built once; handle only picks one.
type stub struct {
	pd          bool // prefill or decode: /generate needs the bootstrap fields
	generate    []byte
	stream      []byte
	missingBoot []byte
	serverInfo  []byte
	modelInfo   []byte
	models      []byte
	load        []byte
	v1Loads     []byte
	streams     sync.Pool // of *sseBody
	unknown     sync.Map  // paths already logged as 404
}

// sseBody hands fasthttp the precomputed stream as a body of unknown length,
// so that it goes out chunked, as SGLang's streams do; Close, which fasthttp
// calls once it is written, returns it to the pool.
type sseBody struct {
	rest []byte
	pool *sync.Pool
}

func (b *sseBody) Read(p []byte) (int, error) {
	if len(b.rest) == 0 {
		return 0, io.EOF
	}
	n := copy(p, b.rest)
	b.rest = b.rest[n:]
	return n, nil
}

func (b *sseBody) Close() error {
	b.rest = nil
	b.pool.Put(b)
	return nil
}

func newStub(role string, tokens int, host string, port int) (*stub, error) {
	mode := role
	switch role {
	case "regular":
		mode = "null" // SGLang's spelling of "not disaggregated"
	case "prefill":
		tokens = 1
	case "decode":
	default:
		return nil, fmt.Errorf("--role %q: want regular, prefill or decode", role)
	}
	if tokens < 1 {
		return nil, fmt.Errorf("--tokens %d: want at least 1", tokens)
	}
	s := &stub{pd: role != "regular"}
	s.streams.New = func() any { return &sseBody{pool: &s.streams} }
	s.generate = genChunk(tokens, true)
	var sse bytes.Buffer
	for k := 1; k <= tokens; k++ {
		sse.WriteString("data: ")
		sse.Write(genChunk(k, k == tokens))
		sse.WriteString("\n\n")
	}
	sse.WriteString("data: [DONE]\n\n")
	s.stream = sse.Bytes()
	s.missingBoot = []byte(`{"object":"error","message":"` + role +
		` server requires bootstrap_host and bootstrap_room in the request","type":"BadRequestError","param":null,"code":400}`)
	s.serverInfo = fmt.Appendf(nil, `{"served_model_name":"mock","model_path":"mock","tokenizer_path":"mock",`+
		`"disaggregation_mode":%q,"disaggregation_bootstrap_port":%d,"dp_size":1,"tp_size":1,"page_size":1,`+
		`"kv_cache_dtype":"auto","disaggregation_transfer_backend":"mooncake","host":%q,"port":%d,"version":"stub",`+
		`"internal_states":[{"num_running_reqs":0,"num_used_tokens":0}]}`, mode, bootstrapPort, host, port)
	s.modelInfo = []byte(`{"model_path":"mock","tokenizer_path":"mock","is_generation":true,"preferred_sampling_params":null,"weight_version":"default"}`)
	s.models = []byte(`{"object":"list","data":[{"id":"mock","object":"model","created":0,"owned_by":"sglang","root":"mock"}]}`)
	s.load = []byte(`[{"dp_rank":0,"num_reqs":0,"num_waiting_reqs":0,"num_tokens":0}]`)
	s.v1Loads = []byte(`{"timestamp":"1970-01-01T00:00:00Z","version":"stub","dp_rank_count":1,"loads":[{"dp_rank":0,` +
		`"num_running_reqs":0,"num_waiting_reqs":0,"num_total_reqs":0,"num_used_tokens":0,"num_total_tokens":0,` +
		`"max_total_num_tokens":1048576,"token_usage":0.0,"gen_throughput":0.0,"cache_hit_rate":0.0,"utilization":0.0,` +
		`"max_running_requests":1024}],"aggregate":{"total_running_reqs":0,"total_waiting_reqs":0,"total_reqs":0,` +
		`"avg_token_usage":0.0,"avg_throughput":0.0,"avg_utilization":0.0}}`)
	return s, nil
}

// genChunk is SGLang's /generate object after k tokens: cumulative text and
// output_ids, finish_reason null until the last.
func genChunk(k int, final bool) []byte {
	var text strings.Builder
	ids := make([]byte, 0, 8*k)
	for i := range k {
		fmt.Fprintf(&text, " tok%d", i)
		if i > 0 {
			ids = append(ids, ',')
		}
		ids = strconv.AppendInt(ids, int64(1000+i), 10)
	}
	finish := "null"
	if final {
		finish = fmt.Sprintf(`{"type":"length","length":%d}`, k)
	}
	return fmt.Appendf(nil, `{"text":%q,"output_ids":[%s],"meta_info":{"id":"00000000000000000000000000000000",`+
		`"finish_reason":%s,"prompt_tokens":%d,"weight_version":"default","total_retractions":0,`+
		`"completion_tokens":%d,"cached_tokens":0,"e2e_latency":0.0001}}`, text.String(), ids, finish, promptTokens, k)
}

func (s *stub) handle(ctx *fasthttp.RequestCtx) {
	// switch on string(bytes) compiles to comparisons, with no allocation.
	switch string(ctx.Path()) {
	case "/generate":
		s.serveGenerate(ctx)
	case "/health", "/health_generate":
	case "/get_server_info", "/server_info":
		reply(ctx, s.serverInfo)
	case "/get_model_info", "/model_info":
		reply(ctx, s.modelInfo)
	case "/v1/models":
		reply(ctx, s.models)
	case "/get_load":
		reply(ctx, s.load)
	case "/v1/loads":
		reply(ctx, s.v1Loads)
	case "/flush_cache":
		ctx.SetContentType("text/plain; charset=utf-8")
		ctx.Response.SetBodyRaw(flushed)
	case "/abort_request":
		if !ctx.IsPost() {
			ctx.Error("method not allowed", fasthttp.StatusMethodNotAllowed)
		}
	default:
		if _, seen := s.unknown.LoadOrStore(string(ctx.Path()), true); !seen {
			fmt.Fprintf(os.Stderr, "stubengine: 404 %s %s\n", ctx.Method(), ctx.Path())
		}
		ctx.Error("not found", fasthttp.StatusNotFound)
	}
}

var flushed = []byte("Cache flushed.\n")

func (s *stub) serveGenerate(ctx *fasthttp.RequestCtx) {
	if !ctx.IsPost() {
		ctx.Error("method not allowed", fasthttp.StatusMethodNotAllowed)
		return
	}
	body := ctx.PostBody()
	if s.pd && !(hasValue(body, bootstrapHostKey) && hasValue(body, bootstrapRoomKey)) {
		ctx.SetStatusCode(fasthttp.StatusBadRequest)
		reply(ctx, s.missingBoot)
		return
	}
	if isTrue(body, streamKey) {
		ctx.SetContentType("text/event-stream")
		ctx.Response.Header.Set("Cache-Control", "no-cache")
		body := s.streams.Get().(*sseBody)
		body.rest = s.stream
		ctx.Response.SetBodyStream(body, -1)
		return
	}
	reply(ctx, s.generate)
}

func reply(ctx *fasthttp.RequestCtx, body []byte) {
	ctx.SetContentType("application/json")
	ctx.Response.SetBodyRaw(body)
}

var (
	streamKey        = []byte(`"stream"`)
	bootstrapHostKey = []byte(`"bootstrap_host"`)
	bootstrapRoomKey = []byte(`"bootstrap_room"`)
)

// valueAfter returns what follows the first `"key":` in a JSON body, spaces
// trimmed, or nil. A key cannot match inside a JSON string, where its quotes
// would be escaped; a nested object's key of the same name would match, which
// no body the bench sends has.
func valueAfter(body, key []byte) []byte {
	for {
		i := bytes.Index(body, key)
		if i < 0 {
			return nil
		}
		body = trimSpace(body[i+len(key):])
		if len(body) > 0 && body[0] == ':' {
			return trimSpace(body[1:])
		}
	}
}

func trimSpace(b []byte) []byte {
	for len(b) > 0 && (b[0] == ' ' || b[0] == '\t' || b[0] == '\n' || b[0] == '\r') {
		b = b[1:]
	}
	return b
}

// hasValue: key present and not null.
func hasValue(body, key []byte) bool {
	v := valueAfter(body, key)
	return len(v) > 0 && !bytes.HasPrefix(v, []byte("null"))
}

func isTrue(body, key []byte) bool { return bytes.HasPrefix(valueAfter(body, key), []byte("true")) }
