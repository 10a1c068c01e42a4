package router

import (
	"bufio"
	"strings"
	"testing"

	"github.com/valyala/fasthttp"
)

// errorCode looks X-SMG-Error-Code up by the name fasthttp stores, not
// normalizing it per request: it finds what a Peek does however the header
// was set (by the router, or copied from a worker's reply under any case).
func TestErrorCodeFindsWhatPeekFinds(t *testing.T) {
	upstream := func(raw string) func(*fasthttp.RequestCtx) {
		return func(ctx *fasthttp.RequestCtx) {
			var h fasthttp.ResponseHeader
			if err := h.Read(bufio.NewReader(strings.NewReader(raw))); err != nil {
				t.Fatal(err)
			}
			copyHeaders(ctx, &upstreamResponse{Header: &h})
		}
	}
	for name, set := range map[string]func(*fasthttp.RequestCtx){
		"none": func(*fasthttp.RequestCtx) {},
		"writeError": func(ctx *fasthttp.RequestCtx) {
			writeError(ctx, &apiError{Status: 503, Code: "no_workers", Message: "m"})
		},
		"Set, lower": func(ctx *fasthttp.RequestCtx) { ctx.Response.Header.Set("x-smg-error-code", "a") },
		"Add, mixed": func(ctx *fasthttp.RequestCtx) { ctx.Response.Header.Add("X-sMg-ErRoR-cOdE", "b") },
		"AddBytesKV": func(ctx *fasthttp.RequestCtx) {
			ctx.Response.Header.AddBytesKV([]byte("x-smg-error-code"), []byte("c"))
		},
		"worker, 2xx":   upstream("HTTP/1.1 200 OK\r\nx-SMG-error-code: d\r\nContent-Length: 0\r\n\r\n"),
		"worker, twice": upstream("HTTP/1.1 200 OK\r\nX-Smg-Error-Code: e\r\nx-smg-error-code: f\r\nContent-Length: 0\r\n\r\n"),
	} {
		var ctx fasthttp.RequestCtx
		set(&ctx)
		want := ctx.Response.Header.Peek("X-SMG-Error-Code")
		if got := errorCode(&ctx); string(got) != string(want) {
			t.Errorf("%s: errorCode %q, Peek %q", name, got, want)
		}
		if name != "none" && len(want) == 0 {
			t.Errorf("%s: no error code set", name)
		}
	}
}

// generation reads the response's X-Request-Id by its stored name: it is
// what a Peek finds, for a client's id and a generated one.
func TestResponseRequestIDFindsWhatPeekFinds(t *testing.T) {
	s := &Server{requestIDNames: []string{"X-Request-Id", "X-Correlation-Id"}}
	for name, header := range map[string]string{
		"client's":  "x-correlation-id: mine-1\r\n",
		"generated": "",
	} {
		var ctx fasthttp.RequestCtx
		raw := "POST /generate HTTP/1.1\r\nHost: r\r\n" + header + "\r\n"
		if err := ctx.Request.Header.Read(bufio.NewReader(strings.NewReader(raw))); err != nil {
			t.Fatal(err)
		}
		s.setRequestID(&ctx)
		want := ctx.Response.Header.Peek("x-request-id")
		if got := responseRequestID(&ctx); len(want) == 0 || string(got) != string(want) {
			t.Errorf("%s: %q, Peek %q", name, got, want)
		}
	}
}

// copyHeaders sets a worker's Content-Type directly; the client gets the
// headers AddBytesKV of each gave it before.
func TestCopyHeadersAsAddedOneByOne(t *testing.T) {
	for _, raw := range []string{
		"HTTP/1.1 200 OK\r\nServer: w\r\nContent-Type: application/json\r\nX-A: 1\r\nx-a: 2\r\nContent-Length: 2\r\n\r\n",
		"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\nCache-Control: no-cache\r\nContent-Length: 0\r\n\r\n",
		"HTTP/1.1 200 OK\r\nX-Only: y\r\nContent-Length: 0\r\n\r\n", // none: the upstream header's default
	} {
		var h fasthttp.ResponseHeader
		if err := h.Read(bufio.NewReader(strings.NewReader(raw))); err != nil {
			t.Fatal(err)
		}
		var got, want fasthttp.RequestCtx
		copyHeaders(&got, &upstreamResponse{Header: &h})
		for k, v := range h.All() {
			if !hopHeader(bstr(k)) {
				want.Response.Header.AddBytesKV(k, v)
			}
		}
		if g, w := got.Response.Header.String(), want.Response.Header.String(); g != w {
			t.Errorf("reply %q:\ngot  %q\nwant %q", raw, g, w)
		}
	}
}
