package router

import (
	"net"

	"github.com/valyala/fasthttp"

	"github.com/pdrouter/pdrouter/balancer"
)

// Regular mode's common request, a non-streamed generation forwarded
// unchanged to one worker and answered with its whole reply, is served on
// event loops (evloop_linux.go): a few goroutines each with an epoll set,
// reading and writing non-blocking sockets, instead of a goroutine and
// fasthttp's machinery per connection. It is the router's work all the
// same: the request id, the route, the body scan, the policy's pick, the
// rid, the worker's load and breaker, the record and the metrics are the
// functions the fasthttp path calls. Anything else goes to fasthttp,
// bytes read included (handOff), so what the lane does not serve it never
// has to get right.

// maxLoopBody is the largest body the loops read themselves; a larger one
// is fasthttp's (frameBody, readBody), whose buffers are made for it.
const maxLoopBody = 1 << 20

// loopLane reports whether the loops serve a request with head h, and its
// route: a POST of a length-framed body to a generation route, by
// HTTP/1.1 on a connection kept alive, that no front-end feature looks at
// (CORS, the router's API key, Expect, tracing) and no limit may queue.
// The body's own test (loopBody) and the workers' (loopWorkers) come next.
func (s *Server) loopLane(h *fasthttp.RequestHeader) (generationRoute, bool) {
	g, ok := generationRoutes[bstr(h.RequestURI())]
	n := h.ContentLength()
	switch {
	case !ok, !h.IsPost(), !h.IsHTTP11(), h.ConnectionClose(),
		n < 0, n > maxLoopBody, n > s.cfg.MaxPayloadSize,
		h.Peek("Origin") != nil, h.Peek("Expect") != nil, h.Peek(leftBodyHeader) != nil,
		s.cfg.APIKey != "", s.trace != nil, s.admission != nil,
		s.cfg.PDDisaggregation, s.cfg.VLLMPDDisaggregation:
		return generationRoute{}, false
	}
	return g, true
}

// loopWorker reports whether the loops can send a request to w: plain
// HTTP/1.1 to an IP address, no key or rank of its own to add.
func loopWorker(w *balancer.Worker) (addr, host string, ok bool) {
	if w.APIKey != "" || w.DPSize > 0 || w.HTTP2 {
		return "", "", false
	}
	addr, host, tlsHost, err := hostPort(w.BaseURL)
	if err != nil || tlsHost != "" {
		return "", "", false
	}
	h, _, err := net.SplitHostPort(addr)
	if err != nil || net.ParseIP(h) == nil {
		return "", "", false
	}
	return addr, host, true
}

// loopListener hands the connections it accepts to the loops, and to
// fasthttp those they do not take.
type loopListener struct {
	net.Listener
	loops *evLoops
}

func (l loopListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil || !l.loops.take(c) {
			return c, err
		}
	}
}
