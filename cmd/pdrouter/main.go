// Command pdrouter is a drop-in replacement for
// `python -m sglang_router.launch_router`: same flags and endpoints, PD
// disaggregated and regular routing. It listens on :8000 by default.
package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/pdrouter/pdrouter/internal/cli"
	"github.com/pdrouter/pdrouter/internal/netutil"
	"github.com/pdrouter/pdrouter/router"
)

func main() { os.Exit(run(os.Args[1:])) }

func run(args []string) int {
	if len(args) > 0 && args[0] == "doctor" {
		return runDoctor(args[1:], os.Stdout, os.Stderr)
	}
	p, o := newParser()
	if err := p.Parse(args); err != nil {
		if err == cli.ErrHelp {
			p.Help(os.Stdout)
			return 0
		}
		p.Usage(os.Stderr, err)
		return 2
	}
	if err := o.security.unimplemented(); err != nil {
		fmt.Fprintln(os.Stderr, "pdrouter:", err)
		return 1
	}
	cfg, err := o.config()
	if err != nil {
		p.Usage(os.Stderr, err)
		return 2
	}
	log, err := newLogger(o.logLevel, o.logDir, o.jsonLog)
	if err != nil {
		fmt.Fprintln(os.Stderr, "pdrouter:", err)
		return 1
	}
	defer log.Sync() //nolint:errcheck // nothing to do about a failed flush at exit
	for _, f := range p.Ignored() {
		log.Warn("flag accepted but not implemented by pdrouter; ignored", zap.String("flag", f))
	}
	if err := o.discovery.apply(&cfg, log); err != nil {
		p.Usage(os.Stderr, err)
		return 2
	}
	if err := serve(cfg, &o.discovery, log); err != nil {
		log.Error("router stopped", zap.Error(err))
		return 1
	}
	return 0
}

func serve(cfg router.Config, discovery *discoveryOptions, log *zap.Logger) error {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	srv, err := router.New(cfg, log, reg)
	if err != nil {
		return err
	}
	if soft, hard, err := netutil.RaiseFileLimit(); err != nil {
		log.Warn("open-file limit unknown", zap.Error(err))
	} else { // the limit until workers serving h2c register (then logged again)
		log.Info("open-file limit", zap.Uint64("soft", soft), zap.Uint64("hard", hard), zap.Int("max_connections", srv.MaxConnections()))
	}
	addr := net.JoinHostPort(cfg.Host, strconv.Itoa(cfg.Port))
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	if err := srv.Start(); err != nil {
		return err
	}
	stopDiscovery, err := discovery.start(srv, log, reg)
	if err != nil {
		return err
	}
	defer stopDiscovery()
	var metrics *http.Server
	if cfg.PrometheusPort > 0 {
		// Like sglang-router's exporter, the metrics listener answers on any path.
		metrics = &http.Server{Addr: net.JoinHostPort(cfg.PrometheusHost, strconv.Itoa(cfg.PrometheusPort)),
			Handler: promhttp.HandlerFor(reg, promhttp.HandlerOpts{}), ReadHeaderTimeout: 10 * time.Second}
		mln, err := net.Listen("tcp", metrics.Addr)
		if err != nil {
			return fmt.Errorf("prometheus listener: %w", err)
		}
		go metrics.Serve(mln) //nolint:errcheck // ends with Shutdown below
	}
	log.Info("pdrouter listening", zap.String("addr", ln.Addr().String()), zap.Bool("https", srv.TLS()), zap.Bool("pd", cfg.PDDisaggregation),
		zap.Int("prefill", len(cfg.Prefill)), zap.Int("decode", len(cfg.Decode)), zap.Int("workers", len(cfg.WorkerURLs)))

	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM)
	select {
	case err := <-served:
		return err
	case s := <-sig:
		log.Info("shutting down: draining in-flight requests", zap.Stringer("signal", s), zap.Duration("grace", cfg.ShutdownGrace))
	}
	stopDiscovery() // no workers join or leave while draining
	ctx, cancel := context.WithTimeout(context.Background(), cfg.ShutdownGrace)
	defer cancel()
	err = srv.Shutdown(ctx)
	if metrics != nil {
		_ = metrics.Shutdown(ctx)
	}
	if errors.Is(err, context.DeadlineExceeded) {
		log.Warn("grace period over: cancelled the requests still in flight")
		return nil
	}
	return err
}

// newLogger writes to stderr and, with --log-dir, also to DIR/smg.log.
func newLogger(level string, dir *string, json bool) (*zap.Logger, error) {
	lvl, err := zapcore.ParseLevel(level)
	if err != nil {
		return nil, err
	}
	cfg := zap.NewProductionConfig()
	if !json {
		cfg.Encoding = "console"
		cfg.EncoderConfig.EncodeTime = zapcore.ISO8601TimeEncoder
	}
	cfg.Level = zap.NewAtomicLevelAt(lvl)
	cfg.Sampling = nil
	cfg.OutputPaths = []string{"stderr"}
	if dir != nil {
		if err := os.MkdirAll(*dir, 0o755); err != nil {
			return nil, fmt.Errorf("log dir: %w", err)
		}
		cfg.OutputPaths = append(cfg.OutputPaths, filepath.Join(*dir, "smg.log"))
	}
	return cfg.Build()
}
