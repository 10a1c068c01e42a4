package router

import (
	"errors"
	"fmt"
	"net"
	"time"

	"github.com/valyala/fasthttp"
	"go.uber.org/zap"

	"github.com/pdrouter/pdrouter/internal/netutil"
	"github.com/pdrouter/pdrouter/router/respond"
)

// Client-side limits: what one client connection may cost the router.

// writeGrace is how long past --request-timeout-secs a response may still
// be written: the request timeout's own end (a stream's error event) goes
// out first, and a client that stopped reading is cut just after.
const writeGrace = 2 * time.Second

// overLimitRefusal is what a connection over --max-connections reads
// before it is closed.
var overLimitRefusal = func() []byte {
	body := respond.Error{Status: 503, Code: "too_many_connections", Message: "too many open connections; retry later"}.Body()
	return fmt.Appendf(nil, "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nX-SMG-Error-Code: too_many_connections\r\n"+
		"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
}()

// limitListener wraps the front-end listener: accept errors pause instead
// of stopping Serve, and connections over MaxConnections are refused with a
// 503 (closed without one on HTTPS, where plaintext would be garbage).
func (s *Server) limitListener(ln net.Listener) net.Listener {
	opt := netutil.Options{MaxConns: s.maxConnections(), OnAcceptError: func(err error, pause time.Duration) {
		s.log.Warn("accept failed; retrying", zap.Error(err), zap.Duration("pause", pause))
	}}
	if s.frontTLS == nil {
		opt.Refusal = overLimitRefusal
	}
	return netutil.Listen(ln, opt)
}

// maxConnections is --max-connections, or DefaultMaxConnections when unset.
func (s *Server) maxConnections() int {
	if s.cfg.MaxConnections > 0 {
		return s.cfg.MaxConnections
	}
	soft, _, err := netutil.RaiseFileLimit()
	if err != nil {
		return 0
	}
	return DefaultMaxConnections(soft, s.cfg.PDDisaggregation)
}

// Descriptor budget. A client connection costs the router its own socket
// and one worker socket per leg of the request it has in flight: one in
// regular mode, two in PD mode (prefill and decode are open together
// until prefill answers, the whole request for a non-stream); fdReserve
// is what is left beside those for everything else: listeners and files,
// probes and the pooled idle worker connections. Half the limit for clients, as
// before, left nothing: 10,000 clients at a limit of 20,000 ran the router
// out of descriptors while their prefill legs were open, and its dials
// failed instead of the surplus clients getting a clean 503.
func fdReserve(fdLimit uint64) uint64 { return min(max(fdLimit/64, 64), 4096) }

// DefaultMaxConnections is the client connection limit for an fd limit:
// every client with its request's worker connections (two in PD mode),
// and fdReserve to spare.
func DefaultMaxConnections(fdLimit uint64, pd bool) int {
	fdLimit = min(fdLimit, 1<<21)
	perClient := uint64(2)
	if pd {
		perClient = 3
	}
	return int(max((fdLimit-min(fdReserve(fdLimit), fdLimit))/perClient, 16))
}

// maxIdlePerWorker bounds a worker's pool of idle connections (500, as
// smg, where the fd limit is large): together the pools of a PD 1P+1D
// router take at most half of fdReserve, leaving the rest to prefill legs
// in flight.
func maxIdlePerWorker(fdLimit uint64) int { return int(min(max(fdReserve(fdLimit)/4, 8), 500)) }

// poolLimit is maxIdlePerWorker for this process's fd limit.
func poolLimit() int {
	soft, _, err := netutil.RaiseFileLimit()
	if err != nil {
		return 500
	}
	return maxIdlePerWorker(soft)
}

// malformed answers what fasthttp could not read as a request. The body
// never repeats the request's bytes: a head may carry credentials.
func malformed(err error) *apiError {
	var small *fasthttp.ErrSmallBuffer
	var ne net.Error
	switch {
	case errors.As(err, &small):
		return &apiError{Status: 431, Code: "request_header_fields_too_large", Message: "request head exceeds the router's header size limit"}
	case errors.As(err, &ne) && ne.Timeout():
		return &apiError{Status: 408, Code: "request_timeout", Message: "request not received in time"}
	}
	return &apiError{Status: 400, Code: "bad_request", Message: "malformed HTTP request"}
}

// fasthttpLog sends fasthttp's own messages (connection-level errors,
// written without request contents: SecureErrorLogMessage) to zap at debug.
type fasthttpLog struct{ log *zap.Logger }

func (l fasthttpLog) Printf(format string, args ...any) {
	if ce := l.log.Check(zap.DebugLevel, "http server"); ce != nil {
		ce.Write(zap.String("detail", fmt.Sprintf(format, args...)))
	}
}
