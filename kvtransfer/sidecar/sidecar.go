// Package sidecar is kvproxy, the KV-transfer sidecar next to one engine,
// as a value: Start brings up its transport, transfer engine, control
// socket, bootstrap API (prefill) and /health and /metrics, and Close takes
// them down in the order that keeps every page mapped until nothing can
// move it. cmd/kvproxy only parses flags into a Config; tests run it in
// process.
//
// The pool segment is allocated when the engine registers its pool over the
// control socket, so a sidecar runs without one until then.
package sidecar

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.uber.org/zap"

	"github.com/pdrouter/pdrouter/internal/netutil"
	"github.com/pdrouter/pdrouter/kvtransfer"
	"github.com/pdrouter/pdrouter/kvtransfer/bootstrap"
	"github.com/pdrouter/pdrouter/kvtransfer/control"
)

// Config is one sidecar. Zero ports mean any free port; zero durations the
// engine's defaults.
type Config struct {
	Role      string // prefill or decode
	Transport string // see Transports
	Control   string // Unix socket the engine connects to
	Host      string // address to listen on and advertise to peers
	// Prefill only: the bootstrap HTTP API; negative: none (SGLang's own
	// bootstrap server runs instead, on SGLang's port).
	BootstrapPort int
	// The peer protocol: rooms (prefill) and engine-owned memory (both
	// roles; an engine reports this address as its rpc address).
	PeerPort         int
	MetricsPort      int           // /health and /metrics
	WriteTimeout     time.Duration // bounds an engine-memory write; 0: 5 s
	BootstrapTimeout time.Duration
	WaitingTimeout   time.Duration
	Heartbeat        time.Duration
	Logger           *zap.Logger // nil: no logs

	bootstrapMaxConns int // 0: maxHTTPConns (tests set fewer)
}

// Addrs is where a started sidecar listens; Bootstrap is empty on a decode
// sidecar, whose peer port serves engine-owned memory only.
type Addrs struct {
	Control   string
	Metrics   string
	Peer      string
	Bootstrap string
}

// Sidecar is a running kvproxy.
type Sidecar struct {
	cfg      Config
	addrs    Addrs
	tr       kvtransfer.Transport
	eng      *kvtransfer.Engine
	mem      *kvtransfer.MemoryPlane
	ctl      *control.Server
	resolver *bootstrap.Resolver // decode
	servers  []*http.Server
	cancel   context.CancelFunc // stops the control server
	wg       sync.WaitGroup     // serving goroutines

	stopped   chan struct{} // closed once, by the first of stop's callers
	stopOnce  sync.Once
	err       error // why it stopped by itself; set before stopped closes
	closeOnce sync.Once
}

// Start brings a sidecar up; when it returns without error everything
// listens and serves.
func Start(cfg Config) (*Sidecar, error) {
	if cfg.Role != "prefill" && cfg.Role != "decode" {
		return nil, fmt.Errorf("role %q: want prefill or decode", cfg.Role)
	}
	if cfg.Logger == nil {
		cfg.Logger = zap.NewNop()
	}
	log := cfg.Logger.With(zap.String("role", cfg.Role))
	tr, err := newTransport(cfg.Transport)
	if err != nil {
		return nil, err
	}
	s := &Sidecar{cfg: cfg, tr: tr, stopped: make(chan struct{})}
	lns, err := s.listen()
	if err != nil {
		_ = tr.Close()
		return nil, err
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	roomLn, memLn := kvtransfer.SplitPeerListener(lns.peer)
	ecfg := kvtransfer.Config{
		Name: cfg.Role + "@" + cfg.Host, Transport: tr, Logger: log, Metrics: kvtransfer.NewMetrics(reg),
		BootstrapTimeout: cfg.BootstrapTimeout, WaitingTimeout: cfg.WaitingTimeout, Heartbeat: cfg.Heartbeat,
	}
	var boot *bootstrap.Server
	if cfg.Role == "prefill" && cfg.BootstrapPort >= 0 {
		boot = bootstrap.NewServer()
	}
	if cfg.Role == "prefill" {
		ecfg.Listener = roomLn
	} else {
		_ = roomLn.Close() // decode accepts no room peers
		s.resolver = bootstrap.NewResolver(0, "")
		// Its own connections, so Close leaves no idle ones behind.
		s.resolver.Client.Transport = http.DefaultTransport.(*http.Transport).Clone()
		ecfg.Resolve = s.resolver.Resolve
	}
	s.mem, err = kvtransfer.NewMemoryPlane(kvtransfer.MemoryConfig{Name: ecfg.Name, Transport: tr, Listener: memLn,
		WriteTimeout: cfg.WriteTimeout, Logger: log, Registry: reg})
	if err == nil {
		if s.eng, err = kvtransfer.New(ecfg); err != nil {
			_ = s.mem.Close()
		}
	}
	if err != nil {
		_ = roomLn.Close()
		_ = memLn.Close()
		lns.close()
		_ = tr.Close()
		return nil, err
	}
	s.ctl = &control.Server{Engine: s.eng, Memory: s.mem, Log: log}
	if boot != nil {
		peerPort := lns.peer.Addr().(*net.TCPAddr).Port
		s.ctl.OnRegister = func(p *kvtransfer.Pool) {
			boot.Register(bootstrap.RankInfo{
				AttnTPSize: 1, AttnCPSize: 1, AttnDPSize: 1, PPSize: 1, SystemDPSize: 1,
				RankIP: cfg.Host, RankPort: peerPort, PageSize: int(p.PageSize), KVCacheDtype: p.Dtype,
				LoadBalanceMethod: "follow_bootstrap_room",
			})
		}
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	mux.HandleFunc("/health", func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprintf(w, "OK rooms_active=%d peers=%d pool_registered=%t\n", s.eng.ActiveRooms(), s.eng.Peers(), s.eng.Pool() != nil)
	})
	s.addrs = Addrs{Control: cfg.Control, Metrics: lns.metrics.Addr().String(), Peer: lns.peer.Addr().String()}
	s.serve(newHTTPServer(mux), lns.metrics)
	if boot != nil {
		s.addrs.Bootstrap = lns.boot.Addr().String()
		srv := newHTTPServer(lns.boot.vouch(boot))
		srv.ConnState = lns.boot.track
		s.serve(srv, lns.boot)
	}
	ctx, cancel := context.WithCancel(context.Background())
	s.cancel = cancel
	s.wg.Add(2)
	go func() {
		defer s.wg.Done()
		if err := s.ctl.Serve(ctx, lns.control); err != nil {
			s.stop(fmt.Errorf("control socket: %w", err))
		}
	}()
	go func() {
		defer s.wg.Done()
		select {
		case <-ctx.Done():
		case <-tr.Done():
			// Every later transfer would fail: stop, so the deployment
			// restarts us, rather than fail each room with the same error.
			err := fmt.Errorf("transport %s stopped: %v", tr.Name(), tr.Err())
			log.Error("transport failed, exiting", zap.Error(err))
			s.stop(err)
		}
	}()
	return s, nil
}

// Connection limits per port: peers are kvproxies (a few per deployment),
// bootstrap clients are engines, metrics are scrapers.
const (
	maxPeerConns    = 1024
	maxHTTPConns    = 1024
	maxMetricsConns = 64
)

// newHTTPServer bounds what a slow or silent client may hold.
func newHTTPServer(h http.Handler) *http.Server {
	return &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second, ReadTimeout: 30 * time.Second,
		WriteTimeout: 30 * time.Second, IdleTimeout: 60 * time.Second, MaxHeaderBytes: 64 << 10}
}

type listeners struct {
	peer, metrics net.Listener
	boot          *connGuard // prefill only
	control       *net.UnixListener
}

func (s *Sidecar) listen() (*listeners, error) {
	l := &listeners{}
	// Every TCP port survives running out of fds and refuses connections
	// over its limit, so a flood on one leaves fds for the others; the
	// bootstrap port keeps slots for the peers that use it (connGuard).
	listen := func(port int) (net.Listener, func(error, time.Duration), error) {
		ln, err := net.Listen("tcp", net.JoinHostPort(s.cfg.Host, strconv.Itoa(port)))
		return ln, func(err error, pause time.Duration) {
			s.cfg.Logger.Warn("accept failed; retrying", zap.Stringer("addr", ln.Addr()), zap.Error(err), zap.Duration("pause", pause))
		}, err
	}
	tcp := func(port, maxConns int) (net.Listener, error) {
		ln, onErr, err := listen(port)
		if err != nil {
			return nil, err
		}
		return netutil.Listen(ln, netutil.Options{MaxConns: maxConns, OnAcceptError: onErr}), nil
	}
	var err error
	l.peer, err = tcp(s.cfg.PeerPort, maxPeerConns)
	if err == nil && s.cfg.Role == "prefill" && s.cfg.BootstrapPort >= 0 {
		ln, onErr, lerr := listen(s.cfg.BootstrapPort)
		if err = lerr; err == nil {
			l.boot = newConnGuard(ln, cmp.Or(s.cfg.bootstrapMaxConns, maxHTTPConns), onErr)
		}
	}
	if err == nil {
		l.metrics, err = tcp(s.cfg.MetricsPort, maxMetricsConns)
	}
	if err == nil {
		err = removeStaleSocket(s.cfg.Control)
	}
	if err == nil {
		l.control, err = net.ListenUnix("unix", &net.UnixAddr{Name: s.cfg.Control, Net: "unix"})
	}
	if err != nil {
		l.close()
		return nil, err
	}
	return l, nil
}

// removeStaleSocket removes the socket an earlier run left at path, but
// not one a running kvproxy still accepts on: unlinking that would cut its
// engine off from it.
func removeStaleSocket(path string) error {
	if c, err := net.Dial("unix", path); err == nil {
		_ = c.Close()
		return fmt.Errorf("control socket %s is in use by a running process", path)
	}
	_ = os.Remove(path)
	return nil
}

func (l *listeners) close() {
	for _, ln := range []net.Listener{l.peer, l.metrics} {
		if ln != nil {
			_ = ln.Close()
		}
	}
	if l.boot != nil {
		_ = l.boot.Close()
	}
	if l.control != nil {
		_ = l.control.Close()
	}
}

func (s *Sidecar) serve(srv *http.Server, ln net.Listener) {
	s.servers = append(s.servers, srv)
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
			s.stop(fmt.Errorf("serve %s: %w", ln.Addr(), err))
		}
	}()
}

// stop records why the sidecar stopped by itself; the first reason wins.
func (s *Sidecar) stop(err error) {
	s.stopOnce.Do(func() {
		s.err = err
		close(s.stopped)
	})
}

// Addrs is where it listens.
func (s *Sidecar) Addrs() Addrs { return s.addrs }

// TransportName is the transport's own name.
func (s *Sidecar) TransportName() string { return s.tr.Name() }

// Engine is its transfer engine.
func (s *Sidecar) Engine() *kvtransfer.Engine { return s.eng }

// Done is closed when the sidecar stopped by itself (its transport broke or
// a server failed); Close then says why.
func (s *Sidecar) Done() <-chan struct{} { return s.stopped }

// Close shuts down: the control socket and the HTTP servers first (the
// engine's connections close, so their rooms are aborted), then the
// transfer engine (no page moves any more), then the transport (pages
// unregistered), and only then is the pool segment unmapped. It returns
// why the sidecar stopped by itself, if it did.
func (s *Sidecar) Close() error {
	s.closeOnce.Do(func() {
		s.cancel()
		for _, srv := range s.servers {
			_ = srv.Close()
		}
		s.wg.Wait()
		_ = s.mem.Close() // the engines' connections are gone, so are their regions
		_ = s.eng.Close()
		_ = s.tr.Close()
		_ = s.ctl.Close()
		if s.resolver != nil {
			s.resolver.Client.CloseIdleConnections()
		}
		_ = os.Remove(s.cfg.Control)
	})
	select {
	case <-s.stopped:
		return s.err
	default:
		return nil
	}
}
