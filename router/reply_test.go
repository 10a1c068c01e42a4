package router

import (
	"bufio"
	"strings"
	"testing"

	"github.com/valyala/fasthttp"
)

// copyHeaders passes a worker's own headers and drops the hop-by-hop and
// framing ones, whatever case the worker wrote them in; from an h2c
// stream's head packed before the wait for its first token (packHead) as
// from the head itself.
func TestCopyHeadersDropsHopHeaders(t *testing.T) {
	long := strings.Repeat("v", 300) // a length of two varint bytes
	raw := "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\nconnection: keep-alive\r\n" +
		"keep-alive: timeout=5\r\nDate: x\r\nServer: eng\r\nX-Request-Id: w\r\nContent-Encoding: gzip\r\n" +
		"Trailer: a\r\nUpgrade: b\r\nProxy-Authenticate: c\r\nX-Engine: e\r\nSet-Cookie: s=1\r\nX-Long: " + long + "\r\n\r\n"
	for _, packed := range []bool{false, true} {
		h := new(fasthttp.ResponseHeader)
		if err := h.Read(bufio.NewReader(strings.NewReader(raw))); err != nil {
			t.Fatal(err)
		}
		resp := &upstreamResponse{Header: h}
		if packed {
			resp.h2 = &h2cStream{header: h}
			resp.packHead()
			if resp.Header != &spentH2CHead || resp.h2.header != nil {
				t.Fatal("packHead kept the head")
			}
		}
		var ctx fasthttp.RequestCtx
		copyHeaders(&ctx, resp)
		got := map[string]string{}
		for k, v := range ctx.Response.Header.All() {
			got[string(k)] = string(v)
		}
		for _, k := range []string{"Connection", "Keep-Alive", "Date", "Server", "X-Request-Id", "Content-Encoding", "Trailer", "Upgrade", "Proxy-Authenticate"} {
			if _, ok := got[k]; ok {
				t.Errorf("packed %v: %s copied: %v", packed, k, got)
			}
		}
		if got["X-Engine"] != "e" || got["Content-Type"] != "application/json" || got["X-Long"] != long || string(ctx.Response.Header.PeekCookie("s")) == "" {
			t.Errorf("packed %v: worker headers lost: %v", packed, got)
		}
	}
}
