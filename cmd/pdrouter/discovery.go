package main

import (
	"context"
	"strings"
	"sync"

	"github.com/go-logr/logr/funcr"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"k8s.io/klog/v2"

	"github.com/pdrouter/pdrouter/internal/cli"
	"github.com/pdrouter/pdrouter/k8sdiscovery"
	"github.com/pdrouter/pdrouter/router"
)

// discoveryOptions are launch_router's "Service Discovery (Kubernetes)" flags.
type discoveryOptions struct {
	enabled                         bool
	selector, prefillSel, decodeSel []string
	port                            int
	namespace                       string
	config                          k8sdiscovery.Config // set by apply
}

func addDiscoveryFlags(p *cli.Parser, d *discoveryOptions) {
	const sd = "Service Discovery (Kubernetes)"
	d.port = 80 // sglang-router's default
	p.Bool(sd, "service-discovery", &d.enabled, "Watch Kubernetes pods and register the Running and Ready ones that match the selectors as workers")
	p.Strings(sd, "selector", &d.selector, true, "Pod label selector in regular mode: key=value ...")
	p.Int(sd, "service-discovery-port", &d.port, "HTTP port of the discovered engines (worker URL http://POD_IP:PORT)")
	p.String(sd, "service-discovery-namespace", &d.namespace, "Namespace to watch (default: all namespaces, which needs cluster-wide RBAC)")
	p.Strings(sd, "prefill-selector", &d.prefillSel, true, "Prefill pod label selector in PD mode: key=value ...; bootstrap port from the pod annotation "+k8sdiscovery.BootstrapPortAnnotation)
	p.Strings(sd, "decode-selector", &d.decodeSel, true, "Decode pod label selector in PD mode: key=value ...")
}

// apply parses the selectors into d.config and, like sglang-router's
// launcher, drops --worker-urls under --service-discovery. It does nothing
// without --service-discovery.
func (d *discoveryOptions) apply(cfg *router.Config, log *zap.Logger) error {
	if !d.enabled {
		return nil
	}
	if len(cfg.WorkerURLs) > 0 {
		log.Warn("--worker-urls is ignored with --service-discovery, as in sglang-router", zap.Strings("worker_urls", cfg.WorkerURLs))
		cfg.WorkerURLs = nil
	}
	pd := cfg.PDDisaggregation
	c := k8sdiscovery.Config{PD: pd, Port: d.port, Namespace: d.namespace}
	var err error
	for _, f := range []struct {
		flag   string
		tokens []string
		dst    *map[string]string
	}{{"--selector", d.selector, &c.Selector}, {"--prefill-selector", d.prefillSel, &c.PrefillSelector},
		{"--decode-selector", d.decodeSel, &c.DecodeSelector}} {
		if *f.dst, err = k8sdiscovery.ParseSelector(f.tokens); err != nil {
			return &router.ConfigError{Rule: f.flag + ": " + err.Error()}
		}
	}
	if err := c.Validate(); err != nil {
		return &router.ConfigError{Rule: err.Error()}
	}
	d.config = c
	return nil
}

// start runs discovery against srv's workers until the returned stop is
// called; without --service-discovery it does nothing.
func (d *discoveryOptions) start(srv *router.Server, log *zap.Logger, reg prometheus.Registerer) (stop func(), err error) {
	if !d.enabled {
		return func() {}, nil
	}
	// client-go logs through klog: send it to our logger instead of stderr.
	klog.SetLogger(funcr.New(func(prefix, args string) {
		log.Debug(strings.TrimSpace(prefix + " " + args))
	}, funcr.Options{}))
	pods, err := k8sdiscovery.NewPods(d.namespace)
	if err != nil {
		return nil, err
	}
	metrics, err := k8sdiscovery.NewMetrics(reg)
	if err != nil {
		return nil, err
	}
	disc, err := k8sdiscovery.New(d.config, pods, srv.Manager(), log, metrics)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		disc.Run(ctx)
	}()
	return sync.OnceFunc(func() { cancel(); <-done }), nil
}
