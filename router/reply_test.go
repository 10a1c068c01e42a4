package router

import (
	"bufio"
	"strings"
	"testing"

	"github.com/valyala/fasthttp"
)

// copyHeaders passes a worker's own headers and drops the hop-by-hop and
// framing ones, whatever case the worker wrote them in.
func TestCopyHeadersDropsHopHeaders(t *testing.T) {
	var h fasthttp.ResponseHeader
	raw := "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\nconnection: keep-alive\r\n" +
		"keep-alive: timeout=5\r\nDate: x\r\nServer: eng\r\nX-Request-Id: w\r\nContent-Encoding: gzip\r\n" +
		"Trailer: a\r\nUpgrade: b\r\nProxy-Authenticate: c\r\nX-Engine: e\r\nSet-Cookie: s=1\r\n\r\n"
	if err := h.Read(bufio.NewReader(strings.NewReader(raw))); err != nil {
		t.Fatal(err)
	}
	var ctx fasthttp.RequestCtx
	copyHeaders(&ctx, &upstreamResponse{Header: &h})
	got := map[string]string{}
	for k, v := range ctx.Response.Header.All() {
		got[string(k)] = string(v)
	}
	for _, k := range []string{"Connection", "Keep-Alive", "Date", "Server", "X-Request-Id", "Content-Encoding", "Trailer", "Upgrade", "Proxy-Authenticate"} {
		if _, ok := got[k]; ok {
			t.Errorf("%s copied: %v", k, got)
		}
	}
	if got["X-Engine"] != "e" || got["Content-Type"] != "application/json" || string(ctx.Response.Header.PeekCookie("s")) == "" {
		t.Errorf("worker headers lost: %v", got)
	}
}
