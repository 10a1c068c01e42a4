package router

import (
	"io"
	"strings"
	"sync"
	"unsafe"

	"github.com/valyala/fasthttp"
)

// forwardHeaders renders sglang-router's whitelist of client headers as
// header lines, once per request (both legs and retries reuse them).
// skipAuth leaves out the client's Authorization (regular mode sends the
// worker's own key instead); requestID is the response's X-Request-Id.
// Names arrive normalized (fasthttp's parser, as hopHeader relies on too),
// so a switch matches them without a case-folding compare per name and
// header.
func forwardHeaders(b []byte, ctx *fasthttp.RequestCtx, skipAuth bool, requestID []byte) []byte {
	for k, v := range ctx.Request.Header.All() {
		switch name := bstr(k); name {
		case "Authorization":
			if skipAuth {
				continue
			}
		case "X-Correlation-Id", "Traceparent", "Tracestate", "X-Smg-Routing-Key":
		default:
			if !strings.HasPrefix(name, "X-Request-Id-") {
				continue
			}
		}
		b = appendHeader(b, k, v)
	}
	return appendHeader(b, headerRequestID, requestID)
}

func appendHeader(b, name, value []byte) []byte {
	b = append(b, name...)
	b = append(b, ": "...)
	b = append(b, value...)
	return append(b, "\r\n"...)
}

// maxErrorBody bounds what is read of an upstream error reply.
const maxErrorBody = 64 << 10

func readError(resp *upstreamResponse) []byte {
	b, _ := io.ReadAll(io.LimitReader(resp, maxErrorBody))
	return b
}

// bstr views bytes as a string without copying, for comparisons only.
func bstr(b []byte) string { return unsafe.String(unsafe.SliceData(b), len(b)) }

// chunkPool holds the buffers streams are relayed through.
var chunkPool = sync.Pool{New: func() any { b := make([]byte, 32<<10); return &b }}
