// Command kvproxy is the KV-transfer sidecar next to one engine: it
// allocates the engine's KV pool in shared memory (UCX-allocated with ucx
// over shared memory, else a memfd), registers it with the transport once,
// hands the engine the segment's fd over the control socket, and moves
// pages to/from peer kvproxies. The prefill kvproxy also serves SGLang's bootstrap API on the bootstrap port. /health
// and /metrics are on the metrics port.
//
// Once everything listens it prints one line:
//
//	kvproxy ready role=R transport=T control=PATH metrics=H:P peer=H:P bootstrap=H:P
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/pdrouter/pdrouter/kvtransfer"
	"github.com/pdrouter/pdrouter/kvtransfer/bootstrap"
	"github.com/pdrouter/pdrouter/kvtransfer/control"
)

type flags struct {
	role, transport, control, host, logLevel string
	bootstrapPort, peerPort, metricsPort     int
	bootstrapTimeout, waitingTimeout, hb     time.Duration
}

func main() {
	var f flags
	flag.StringVar(&f.role, "role", "prefill", "prefill or decode")
	flag.StringVar(&f.transport, "transport", "ucx", "ucx or tcp (UCX_TLS passes through to ucx)")
	flag.StringVar(&f.control, "control", "/tmp/kvproxy.sock", "Unix socket the engine connects to")
	flag.StringVar(&f.host, "host", "127.0.0.1", "address to listen on and advertise to peers")
	flag.IntVar(&f.bootstrapPort, "bootstrap-port", 8998, "prefill: bootstrap HTTP API port")
	flag.IntVar(&f.peerPort, "peer-port", 0, "prefill: peer protocol port (0: any)")
	flag.IntVar(&f.metricsPort, "metrics-port", 0, "/health and /metrics port (0: any)")
	flag.DurationVar(&f.bootstrapTimeout, "bootstrap-timeout", 300*time.Second, "a room not matched by its peer within this fails")
	flag.DurationVar(&f.waitingTimeout, "waiting-timeout", 300*time.Second, "a matched room not finished within this fails")
	flag.DurationVar(&f.hb, "heartbeat-interval", 5*time.Second, "peer heartbeat; two missed intervals fail the peer's rooms")
	flag.StringVar(&f.logLevel, "log-level", "info", "debug, info, warn or error")
	flag.Parse()
	if err := run(f); err != nil {
		fmt.Fprintln(os.Stderr, "kvproxy:", err)
		os.Exit(1)
	}
}

// transports maps --transport names to constructors; ucx is added by a
// cgo-only file.
var transports = map[string]func() (kvtransfer.Transport, error){
	"tcp": func() (kvtransfer.Transport, error) { return &kvtransfer.TCP{}, nil },
}

func run(f flags) error {
	if f.role != "prefill" && f.role != "decode" {
		return fmt.Errorf("--role %q: want prefill or decode", f.role)
	}
	newTransport, ok := transports[f.transport]
	if !ok {
		return fmt.Errorf("--transport %q not available in this build", f.transport)
	}
	var level zapcore.Level
	if err := level.Set(f.logLevel); err != nil {
		return err
	}
	zc := zap.NewProductionConfig()
	zc.Level = zap.NewAtomicLevelAt(level)
	log, err := zc.Build()
	if err != nil {
		return err
	}
	defer log.Sync()
	log = log.With(zap.String("role", f.role))

	tr, err := newTransport()
	if err != nil {
		return fmt.Errorf("transport %s: %w", f.transport, err)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	cfg := kvtransfer.Config{
		Name: f.role + "@" + f.host, Transport: tr, Logger: log, Metrics: kvtransfer.NewMetrics(reg),
		BootstrapTimeout: f.bootstrapTimeout, WaitingTimeout: f.waitingTimeout, Heartbeat: f.hb,
	}
	var boot *bootstrap.Server
	var peerLn, bootLn, metricsLn net.Listener
	var ctlLn *net.UnixListener
	listen := func(port int) (net.Listener, error) {
		return net.Listen("tcp", net.JoinHostPort(f.host, strconv.Itoa(port)))
	}
	if f.role == "prefill" {
		if peerLn, err = listen(f.peerPort); err == nil {
			bootLn, err = listen(f.bootstrapPort)
		}
		cfg.Listener, boot = peerLn, bootstrap.NewServer()
	} else {
		cfg.Resolve = bootstrap.NewResolver(0, "").Resolve
	}
	if err == nil {
		metricsLn, err = listen(f.metricsPort)
	}
	if err == nil {
		_ = os.Remove(f.control)
		ctlLn, err = net.ListenUnix("unix", &net.UnixAddr{Name: f.control, Net: "unix"})
	}
	if err != nil {
		for _, l := range []net.Listener{peerLn, bootLn, metricsLn} {
			if l != nil {
				l.Close()
			}
		}
		tr.Close()
		return err
	}
	defer os.Remove(f.control)
	eng, err := kvtransfer.New(cfg)
	if err != nil {
		return err
	}
	ctl := &control.Server{Engine: eng, Log: log}
	// Shutdown order matters: the engine stops moving pages, then the
	// transport unregisters them, then the pool is unmapped.
	defer func() {
		eng.Close()
		tr.Close()
		ctl.Close()
	}()
	if boot != nil {
		peerPort := peerLn.Addr().(*net.TCPAddr).Port
		ctl.OnRegister = func(p *kvtransfer.Pool) {
			boot.Register(bootstrap.RankInfo{
				AttnTPSize: 1, AttnCPSize: 1, AttnDPSize: 1, PPSize: 1, SystemDPSize: 1,
				RankIP: f.host, RankPort: peerPort, PageSize: int(p.PageSize), KVCacheDtype: p.Dtype,
				LoadBalanceMethod: "follow_bootstrap_room",
			})
		}
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	mux.HandleFunc("/health", func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprintf(w, "OK rooms_active=%d peers=%d pool_registered=%t\n", eng.ActiveRooms(), eng.Peers(), eng.Pool() != nil)
	})

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	errc := make(chan error, 3)
	servers := []*http.Server{{Handler: mux}}
	go func() { errc <- servers[0].Serve(metricsLn) }()
	bootAddr, peerAddr := "-", "-"
	if boot != nil {
		servers = append(servers, &http.Server{Handler: boot})
		go func() { errc <- servers[1].Serve(bootLn) }()
		bootAddr, peerAddr = bootLn.Addr().String(), peerLn.Addr().String()
	}
	ctlDone := make(chan struct{})
	go func() {
		defer close(ctlDone)
		if err := ctl.Serve(ctx, ctlLn); err != nil {
			errc <- err
		}
	}()
	fmt.Printf("kvproxy ready role=%s transport=%s control=%s metrics=%s peer=%s bootstrap=%s\n",
		f.role, tr.Name(), f.control, metricsLn.Addr(), peerAddr, bootAddr)

	var runErr error
	select {
	case <-ctx.Done():
	case runErr = <-errc:
	case <-tr.Done():
		// Every later transfer would fail: exit non-zero so the deployment
		// restarts us, rather than fail each room with the same error.
		runErr = fmt.Errorf("transport %s stopped: %v", tr.Name(), tr.Err())
		log.Error("transport failed, exiting", zap.Error(runErr))
	}
	stop()
	for _, s := range servers {
		_ = s.Close()
	}
	<-ctlDone
	if errors.Is(runErr, http.ErrServerClosed) {
		runErr = nil
	}
	return runErr
}
