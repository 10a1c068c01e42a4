package router

import (
	"errors"
	"fmt"
	"net"
	"sync"
	"time"

	"github.com/valyala/fasthttp"
	"go.uber.org/zap"

	"github.com/pdrouter/pdrouter/balancer"
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
// of stopping Serve, and connections over the client limit are refused with
// a 503 (closed without one on HTTPS, where plaintext would be garbage).
func (s *Server) limitListener(ln net.Listener) net.Listener {
	opt := netutil.Options{OnAcceptError: func(err error, pause time.Duration) {
		s.log.Warn("accept failed; retrying", zap.Error(err), zap.Duration("pause", pause))
	}}
	if s.frontTLS == nil {
		opt.Refusal = overLimitRefusal
	}
	s.front.mu.Lock()
	defer s.front.mu.Unlock()
	opt.MaxConns = s.maxConnectionsFor(s.front.snap)
	l := netutil.Listen(ln, opt)
	s.front.listeners = append(s.front.listeners, l)
	return l
}

// frontLimit keeps the front listeners' client limit in step with the
// workers: whether they serve h2c changes what a client costs.
type frontLimit struct {
	mu        sync.Mutex
	snap      *balancer.Snapshot // the registry's latest; nil before the first
	listeners []*netutil.Listener
}

// followLimit is told each worker snapshot; without --max-connections it
// sets the listeners' limit to what the new worker set lets clients cost.
func (s *Server) followLimit(snap *balancer.Snapshot) {
	s.front.mu.Lock()
	defer s.front.mu.Unlock()
	was, now := s.maxConnectionsFor(s.front.snap), s.maxConnectionsFor(snap)
	s.front.snap = snap
	if now == was {
		return
	}
	for _, l := range s.front.listeners {
		l.SetMaxConns(now)
	}
	legs := upstreamLegs(s.sides(), snap)
	s.log.Info("client connection limit changed", zap.Int("max_connections", now), zap.Int("was", was),
		zap.Int("http1_legs_per_client", legs.HTTP1), zap.Int("h2c_workers", legs.H2CWorkers))
}

// MaxConnections is the client limit for the registry's latest workers.
func (s *Server) MaxConnections() int {
	s.front.mu.Lock()
	defer s.front.mu.Unlock()
	return s.maxConnectionsFor(s.front.snap)
}

// maxConnectionsFor is --max-connections, or DefaultMaxConnections for the
// workers of snap when unset.
func (s *Server) maxConnectionsFor(snap *balancer.Snapshot) int {
	if s.cfg.MaxConnections > 0 {
		return s.cfg.MaxConnections
	}
	soft, _, err := netutil.RaiseFileLimit()
	if err != nil {
		return 0
	}
	return DefaultMaxConnections(soft, upstreamLegs(s.sides(), snap))
}

// Descriptor budget. A client connection costs the router its own socket
// and one worker socket per leg of its request over HTTP/1.1: one in
// regular mode, two in PD mode (prefill and decode are open together
// until prefill answers, the whole request for a non-stream). A leg over
// h2c is a stream on a connection shared with up to h2cDefaultStreams
// others. fdReserve is what is left beside those for everything else:
// listeners and files, probes and the pooled idle worker connections. Half
// the limit for clients, as before, left nothing: 10,000 clients at a
// limit of 20,000 ran the router out of descriptors while their prefill
// legs were open, and its dials failed instead of the surplus clients
// getting a clean 503.
func fdReserve(fdLimit uint64) uint64 { return min(max(fdLimit/64, 64), 4096) }

// h2cWorkerAllowance is the descriptors an h2c worker may hold beyond its
// full connections: one not yet full, one being dialed, two draining
// after a GOAWAY.
const h2cWorkerAllowance = 4

// UpstreamLegs is what a client's request holds towards the workers.
type UpstreamLegs struct {
	HTTP1      int // legs over HTTP/1.1: a worker socket each, per client
	H2C        int // legs over h2c: a stream each
	H2CWorkers int // workers those h2c legs may go to
}

// upstreamLegs counts the legs of a request to the given sides: a side is
// h2c when it has workers and all of them serve h2c (before any has
// registered, its /server_info unread, it counts as HTTP/1.1).
func upstreamLegs(sides []balancer.WorkerType, snap *balancer.Snapshot) UpstreamLegs {
	var legs UpstreamLegs
	for _, t := range sides {
		var workers []*balancer.Worker
		if snap != nil {
			workers = snap.ByType[t]
		}
		h2c := len(workers) > 0
		for _, w := range workers {
			h2c = h2c && w.HTTP2
		}
		if h2c {
			legs.H2C++
			legs.H2CWorkers += len(workers)
		} else {
			legs.HTTP1++
		}
	}
	return legs
}

// DefaultMaxConnections is the client connection limit for an fd limit:
// every client with its request's HTTP/1.1 worker sockets and its share of
// the h2c connections (one per h2cDefaultStreams streams; RFC 9113 asks
// servers for at least 100), with fdReserve and each h2c worker's
// allowance to spare.
func DefaultMaxConnections(fdLimit uint64, legs UpstreamLegs) int {
	fdLimit = min(fdLimit, 1<<21)
	spare := fdReserve(fdLimit) + h2cWorkerAllowance*uint64(legs.H2CWorkers)
	perHundred := h2cDefaultStreams*(1+uint64(legs.HTTP1)) + uint64(legs.H2C) // descriptors per h2cDefaultStreams clients
	return int(max((fdLimit-min(spare, fdLimit))*h2cDefaultStreams/perHundred, 16))
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
