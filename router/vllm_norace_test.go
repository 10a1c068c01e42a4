//go:build !race

package router

import (
	"net"
	"testing"

	"github.com/valyala/fasthttp"
)

// A non-streamed vLLM PD request costs the router three allocations: the
// request and each leg's reply (upstream.go). Both legs' bodies come from
// a pool, the decode's with the prefill's long kv_transfer_params too, and
// the request id is written without a buffer of its own. What the client
// and fasthttp's server cost with the router's settings (ReduceMemoryUsage
// in PD mode: a byte read per request) is measured apart and taken off.
// Not under -race, whose sync.Pool drops items.
func TestVLLMRequestAllocations(t *testing.T) {
	base, _ := serveInProcess(t, cannedVLLMConfig(t))
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	bare := &fasthttp.Server{Handler: func(*fasthttp.RequestCtx) {}, ReduceMemoryUsage: true}
	go bare.Serve(ln) //nolint:errcheck // ends at Shutdown
	t.Cleanup(func() { _ = bare.Shutdown() })

	c := &fasthttp.Client{}
	req, resp := fasthttp.AcquireRequest(), fasthttp.AcquireResponse()
	defer fasthttp.ReleaseRequest(req)
	defer fasthttp.ReleaseResponse(resp)
	allocs := func(url string) float64 {
		post := func() {
			req.SetRequestURI(url)
			req.Header.SetMethod("POST")
			req.SetBody(cannedVLLMRequest)
			if err := c.Do(req, resp); err != nil || resp.StatusCode() != 200 {
				t.Fatalf("%v %d %s", err, resp.StatusCode(), resp.Body())
			}
		}
		for range 50 { // warm the pools and the client's connection
			post()
		}
		return testing.AllocsPerRun(500, post)
	}
	bareN := allocs("http://" + ln.Addr().String() + "/v1/completions")
	routed := allocs(base + "/v1/completions")
	if n := routed - bareN; n > 3 {
		t.Errorf("the router allocates %.1f times per vLLM request (%.1f in all, %.1f without it), want at most 3", n, routed, bareN)
	}
}
