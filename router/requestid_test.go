package router

import (
	"testing"

	"github.com/valyala/fasthttp"
)

// clientRequestID finds what a Peek per configured name, in order, found.
func TestClientRequestIDMatchesPeekPerName(t *testing.T) {
	names := DefaultConfig().RequestIDHeaders // x-request-id, x-correlation-id, x-trace-id, request-id
	var normalized []string
	for _, n := range names {
		normalized = append(normalized, string(fasthttp.AppendNormalizedHeaderKey(nil, n)))
	}
	for _, tc := range []struct {
		name    string
		headers []string // name, value, ...
	}{
		{"none", []string{"Content-Type", "application/json"}},
		{"one", []string{"x-trace-id", "t1"}},
		{"config order wins over header order", []string{"Request-Id", "r1", "X-Correlation-ID", "c1"}},
		{"first listed", []string{"x-trace-id", "t1", "x-request-id", "q1"}},
		{"empty counts as none", []string{"x-request-id", "", "x-trace-id", "t1"}},
		{"first occurrence only", []string{"x-correlation-id", "", "x-correlation-id", "c2", "request-id", "r1"}},
		{"repeated, first kept", []string{"x-trace-id", "t1", "x-trace-id", "t2"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var h fasthttp.RequestHeader
			for i := 0; i < len(tc.headers); i += 2 {
				h.Add(tc.headers[i], tc.headers[i+1])
			}
			var want []byte
			for _, n := range names {
				if v := h.Peek(n); len(v) > 0 {
					want = v
					break
				}
			}
			if got := clientRequestID(&h, normalized); string(got) != string(want) || (got == nil) != (want == nil) {
				t.Fatalf("clientRequestID = %q, Peek per name = %q", got, want)
			}
		})
	}
}
