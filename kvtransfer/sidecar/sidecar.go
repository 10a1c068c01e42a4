// Package sidecar is kvproxy, the KV-transfer sidecar next to one engine,
// as a value: Start brings up its transport, transfer engine, control
// socket, bootstrap API (prefill) and /health and /metrics, and Close takes
// them down in the order that keeps every page mapped until nothing can
// move it. cmd/kvproxy only parses flags into a Config; tests run it in
// process.
//
// The engine registers its own memory over the control socket; rooms work
// once it also described its KV layout there.
package sidecar

import (
	"cmp"
	"context"
	"encoding/json"
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
	"github.com/pdrouter/pdrouter/kvtransfer/rooms"
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
	// The peer protocol (an engine reports this address as its rpc
	// address; the bootstrap API hands it to decode kvproxies).
	PeerPort     int
	MetricsPort  int           // /health and /metrics
	WriteTimeout time.Duration // bounds an engine-memory write; 0: 5 s
	// HostID names this machine to peer kvproxies (default: the boot id);
	// two kvproxies of one host with different ids treat each other as
	// remote (GPU KV then takes the staged path).
	HostID           string
	StageChunk       int // the staged path's gather size (0: 1 MiB)
	BootstrapTimeout time.Duration
	WaitingTimeout   time.Duration
	Heartbeat        time.Duration
	Logger           *zap.Logger // nil: no logs

	bootstrapMaxConns int // 0: maxHTTPConns (tests set fewer)
}

// DefaultConfig is kvproxy's defaults, which its flags read: the one
// place they are written down.
func DefaultConfig() Config {
	return Config{
		Role:             "prefill",
		Transport:        "ucx",
		Control:          "/tmp/kvproxy.sock",
		Host:             "127.0.0.1",
		BootstrapPort:    8998,
		WriteTimeout:     5 * time.Second,
		BootstrapTimeout: 300 * time.Second,
		WaitingTimeout:   300 * time.Second,
		Heartbeat:        5 * time.Second,
	}
}

// Addrs is where a started sidecar listens; Bootstrap is empty on a decode
// sidecar.
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
	rooms    *rooms.Rooms
	mem      *kvtransfer.MemoryPlane
	ctl      *control.Server
	resolver *bootstrap.Resolver // decode
	servers  []*http.Server
	cancel   context.CancelFunc // stops the control server
	wg       sync.WaitGroup     // serving goroutines

	// stopped ends when the sidecar stopped by itself, stop's first
	// caller's error its cause.
	stopped   context.Context
	stop      context.CancelCauseFunc
	closeOnce sync.Once
}

// Start brings a sidecar up; when it returns without error everything
// listens and serves.
func Start(cfg Config) (*Sidecar, error) {
	if cfg.Role != "prefill" && cfg.Role != "decode" {
		return nil, fmt.Errorf("role %q: want prefill or decode", cfg.Role)
	}
	cfg.Logger = cmp.Or(cfg.Logger, zap.NewNop())
	log := cfg.Logger.With(zap.String("role", cfg.Role))
	tr, err := newTransport(cfg.Transport, cfg.HostID)
	if err != nil {
		return nil, err
	}
	s := &Sidecar{cfg: cfg, tr: tr}
	s.stopped, s.stop = context.WithCancelCause(context.Background())
	lns, err := s.listen()
	if err != nil {
		_ = tr.Close()
		return nil, err
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	rcfg := rooms.Config{
		Logger: log, Registry: reg,
		BootstrapTimeout: cfg.BootstrapTimeout, WaitingTimeout: cfg.WaitingTimeout, Heartbeat: cfg.Heartbeat,
	}
	if cfg.Role == "decode" {
		s.resolver = bootstrap.NewResolver(0, "")
		// Its own connections, so Close leaves no idle ones behind.
		s.resolver.Client.Transport = http.DefaultTransport.(*http.Transport).Clone()
		rcfg.Resolve = s.resolver.Resolve
	}
	s.mem, err = kvtransfer.NewMemoryPlane(kvtransfer.MemoryConfig{Name: cfg.Role + "@" + cfg.Host, Transport: tr, Listener: lns.peer,
		WriteTimeout: cfg.WriteTimeout, Logger: log, Registry: reg, HostID: cfg.HostID, StageChunk: cfg.StageChunk})
	if err == nil {
		rcfg.Memory = s.mem
		if s.rooms, err = rooms.New(rcfg); err != nil {
			_ = s.mem.Close()
		}
	}
	if err != nil {
		lns.close()
		_ = tr.Close()
		return nil, err
	}
	s.ctl = &control.Server{Rooms: s.rooms, Memory: s.mem, Log: log}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	mux.HandleFunc("/status", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(s.mem.Paths())
	})
	mux.HandleFunc("/health", func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprintf(w, "OK rooms_active=%d peers=%d regions=%d layout_registered=%t\n", s.rooms.ActiveRooms(), s.mem.Links(), s.mem.Regions(), s.rooms.Layout() != nil)
	})
	s.addrs = Addrs{Control: cfg.Control, Metrics: lns.metrics.Addr().String(), Peer: lns.peer.Addr().String()}
	s.serve(newHTTPServer(mux), lns.metrics)
	if lns.boot != nil { // prefill, unless SGLang serves its own
		boot := bootstrap.NewServer()
		peerPort := lns.peer.Addr().(*net.TCPAddr).Port
		s.ctl.OnLayout = func(l rooms.Layout) {
			boot.Register(bootstrap.RankInfo{
				AttnTPSize: 1, AttnCPSize: 1, AttnDPSize: 1, PPSize: 1, SystemDPSize: 1,
				RankIP: cfg.Host, RankPort: peerPort, PageSize: int(l.PageSize), KVCacheDtype: l.Dtype,
				LoadBalanceMethod: "follow_bootstrap_room",
			})
		}
		s.addrs.Bootstrap = lns.boot.Addr().String()
		srv := newHTTPServer(lns.boot.vouch(boot))
		srv.ConnState = lns.boot.track
		s.serve(srv, lns.boot)
	}
	ctx, cancel := context.WithCancel(context.Background())
	s.cancel = cancel
	s.wg.Go(func() {
		if err := s.ctl.Serve(ctx, lns.control); err != nil {
			s.stop(fmt.Errorf("control socket: %w", err))
		}
	})
	s.wg.Go(func() {
		select {
		case <-ctx.Done():
		case <-tr.Done():
			// Every later transfer would fail: stop, so the deployment
			// restarts us, rather than fail each room with the same error.
			err := fmt.Errorf("transport %s stopped: %v", tr.Name(), tr.Err())
			log.Error("transport failed, exiting", zap.Error(err))
			s.stop(err)
		}
	})
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
	s.wg.Go(func() {
		if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
			s.stop(fmt.Errorf("serve %s: %w", ln.Addr(), err))
		}
	})
}

// Addrs is where it listens.
func (s *Sidecar) Addrs() Addrs { return s.addrs }

// TransportName is the transport's own name.
func (s *Sidecar) TransportName() string { return s.tr.Name() }

// Rooms is its room layer.
func (s *Sidecar) Rooms() *rooms.Rooms { return s.rooms }

// Done is closed when the sidecar stopped by itself (its transport broke or
// a server failed); Close then says why.
func (s *Sidecar) Done() <-chan struct{} { return s.stopped.Done() }

// Close shuts down: the control socket and the HTTP servers first (the
// engine's connections close, so their rooms are aborted and their memory
// dropped), then the rooms and the memory plane (no byte moves any more),
// then the transport. It returns why the sidecar stopped by itself, if it
// did.
func (s *Sidecar) Close() error {
	s.closeOnce.Do(func() {
		s.cancel()
		for _, srv := range s.servers {
			_ = srv.Close()
		}
		s.wg.Wait()
		_ = s.rooms.Close()
		_ = s.mem.Close() // the engines' connections are gone, so are their regions
		_ = s.tr.Close()
		if s.resolver != nil {
			s.resolver.Client.CloseIdleConnections()
		}
		_ = os.Remove(s.cfg.Control)
	})
	return context.Cause(s.stopped)
}
