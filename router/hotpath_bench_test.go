package router

import (
	"net"
	"strconv"
	"testing"

	"github.com/valyala/fasthttp"
)

// cannedBackend answers every POST at once with a fixed reply: it stands in
// for an engine so the benchmarks measure the router's own cost (and
// scripts/walk-files.sh follows one request).
func cannedBackend(b testing.TB, stream bool) string {
	b.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	reply := []byte(`{"text":" tok1 tok2 tok3 tok4","meta_info":{"id":"x","prompt_tokens":3,"completion_tokens":4}}`)
	srv := &fasthttp.Server{Handler: func(ctx *fasthttp.RequestCtx) {
		switch string(ctx.Path()) {
		case "/health":
		case "/get_server_info", "/server_info":
			ctx.SetBodyString(`{"served_model_name":"mock"}`)
		default:
			if stream {
				ctx.SetContentType("text/event-stream")
				for i := range 8 {
					ctx.WriteString(`data: {"text":"tok` + strconv.Itoa(i) + `"}` + "\n\n")
				}
				ctx.WriteString("data: [DONE]\n\n")
				return
			}
			ctx.SetContentType("application/json")
			ctx.SetBody(reply)
		}
	}}
	go srv.Serve(ln) //nolint:errcheck // ends at Shutdown
	b.Cleanup(func() { _ = srv.Shutdown() })
	return "http://" + ln.Addr().String()
}

func benchRouter(b *testing.B, pd, stream bool) {
	cfg := DefaultConfig()
	if pd {
		cfg.PDDisaggregation = true
		cfg.Prefill = []PrefillSpec{{URL: cannedBackend(b, stream), BootstrapPort: 8998}}
		cfg.Decode = []string{cannedBackend(b, stream)}
	} else {
		cfg.WorkerURLs = []string{cannedBackend(b, stream)}
	}
	base, srv := serveInProcess(b, cfg)
	body := []byte(`{"text":"The quick brown fox jumps over the lazy dog","sampling_params":{"max_new_tokens":4},"stream":` + strconv.FormatBool(stream) + `}`)
	benchPosts(b, srv, base+"/generate", body)
}

// benchPosts posts body to url from parallel clients, b.N times in all,
// then shuts srv down.
func benchPosts(b *testing.B, srv *Server, url string, body []byte) {
	c := &fasthttp.Client{}
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		req, resp := fasthttp.AcquireRequest(), fasthttp.AcquireResponse()
		defer fasthttp.ReleaseRequest(req)
		defer fasthttp.ReleaseResponse(resp)
		for pb.Next() {
			req.SetRequestURI(url)
			req.Header.SetMethod("POST")
			req.SetBody(body)
			if err := c.Do(req, resp); err != nil || resp.StatusCode() != 200 {
				b.Fatalf("%v %d %s", err, resp.StatusCode(), resp.Body())
			}
		}
	})
	b.StopTimer()
	_ = srv.Shutdown(b.Context())
}

// The router's whole per-request cost (client, router and canned backends
// share the process, so compare runs, not absolute figures).
func BenchmarkRegular(b *testing.B)  { benchRouter(b, false, false) }
func BenchmarkPD(b *testing.B)       { benchRouter(b, true, false) }
func BenchmarkPDStream(b *testing.B) { benchRouter(b, true, true) }
