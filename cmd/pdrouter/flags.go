package main

import (
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/pdrouter/pdrouter/balancer"
	"github.com/pdrouter/pdrouter/internal/cli"
	"github.com/pdrouter/pdrouter/router"
)

// options are launch_router's flags (sglang-router 0.3.x, spec §1.3) before
// they become a router.Config.
type options struct {
	host, policy                       string
	prefillPolicy, decodePolicy        *string
	port                               int
	workerURLs                         []string
	pd                                 bool
	prefill, decode                    [][]string
	startupTimeout, startupInterval    int
	cacheThreshold, balanceRel         float64
	balanceAbs, evictionInterval       int
	maxTreeSize, maxIdle, bucketAdjust int
	assignmentMode                     string
	maxPayload                         int
	apiKey, logDir                     *string
	logLevel                           string
	jsonLog                            bool
	promPort                           int
	promHost                           string
	requestIDHeaders                   []string
	requestTimeout, shutdownGrace      int
	cors                               []string
	maxConcurrent, queueSize           int
	queueTimeout                       int
	rateLimit                          *string
	retryMax, retryInitial, retryMaxMS int
	retryMult, retryJitter             float64
	disableRetries                     bool
	cbFail, cbSuccess, cbTimeout       int
	cbWindow                           int
	disableCB                          bool
	healthFail, healthSuccess          int
	healthTimeout, healthInterval      int
	healthEndpoint                     string
	disableHealth                      bool
	// accepted for compatibility only
	ignoredBool    bool
	ignoredString  string
	ignoredOpt     *string
	ignoredInt     int
	ignoredList    []string
	ignoredFloats  []string
	ignoredAppends [][]string
}

var policies = []string{"random", "round_robin", "cache_aware", "power_of_two", "manual", "consistent_hashing", "prefix_hash"}

func newParser() (*cli.Parser, *options) {
	o := &options{
		host: "0.0.0.0", port: 8000, policy: "cache_aware",
		startupTimeout: 1800, startupInterval: 30,
		cacheThreshold: 0.3, balanceAbs: 64, balanceRel: 1.5, evictionInterval: 60,
		maxTreeSize: 1 << 26, maxIdle: 4 * 3600, bucketAdjust: 5, assignmentMode: "random",
		maxPayload: 512 << 20, logLevel: "info", promPort: 29000, promHost: "0.0.0.0",
		requestTimeout: 1800, shutdownGrace: 180, maxConcurrent: -1, queueSize: 100, queueTimeout: 60,
		retryMax: 5, retryInitial: 50, retryMaxMS: 30000, retryMult: 1.5, retryJitter: 0.2,
		cbFail: 10, cbSuccess: 3, cbTimeout: 60, cbWindow: 120,
		healthFail: 3, healthSuccess: 2, healthTimeout: 5, healthInterval: 60, healthEndpoint: "/health",
	}
	p := cli.New("pdrouter", "pdrouter: a drop-in for `python -m sglang_router.launch_router` (prefill/decode disaggregated and regular routing). The default port is 8000, not sglang-router's 30000.")
	const w, r, pd, lg, pr, rq, rl, rt, cb, hc = "Worker Configuration", "Routing Policy", "PD Disaggregation", "Logging",
		"Prometheus Metrics", "Request Handling", "Rate Limiting", "Retry Configuration", "Circuit Breaker", "Health Checks"
	p.String(w, "host", &o.host, "Host address to bind the router server (IPv4 or IPv6)")
	p.Int(w, "port", &o.port, "Port number to bind the router server")
	p.Strings(w, "worker-urls", &o.workerURLs, false, "Worker URLs for regular (non-PD) mode")

	p.String(r, "policy", &o.policy, "Load balancing policy; in PD mode used for both sides unless overridden", policies...)
	p.OptString(r, "prefill-policy", &o.prefillPolicy, "Policy for prefill workers in PD mode", append(policies, "bucket")...)
	p.OptString(r, "decode-policy", &o.decodePolicy, "Policy for decode workers in PD mode", policies...)
	p.Float(r, "cache-threshold", &o.cacheThreshold, "Prefix match ratio (0.0-1.0) above which cache_aware reuses a worker")
	p.Int(r, "balance-abs-threshold", &o.balanceAbs, "Absolute load difference that triggers balancing")
	p.Float(r, "balance-rel-threshold", &o.balanceRel, "Relative load ratio that triggers balancing")
	p.Int(r, "bucket-adjust-interval-secs", &o.bucketAdjust, "Seconds between bucket boundary adjustments")
	p.Int(r, "eviction-interval-secs", &o.evictionInterval, "Seconds between cache tree evictions")
	p.Int(r, "max-tree-size", &o.maxTreeSize, "Bound of the cache_aware tree (bytes, over all workers)")
	p.Int(r, "max-idle-secs", &o.maxIdle, "Idle seconds before a manual-policy routing key is evicted")
	p.String(r, "assignment-mode", &o.assignmentMode, "How the manual policy assigns new routing keys", "random", "min_load", "min_group")
	p.Int(r, "max-payload-size", &o.maxPayload, "Maximum request body in bytes (larger is a 413)")
	p.Bool(r, "dp-aware", &o.ignoredBool, "Data-parallel aware scheduling").Ignored = true
	p.Bool(r, "enable-igw", &o.ignoredBool, "Multi-model gateway mode").Ignored = true
	p.Bool(r, "allow-requests-without-routing-key", &o.ignoredBool, "Allow keyless requests under consistent_hashing/manual").Ignored = true

	p.Bool(pd, "mini-lb", &o.ignoredBool, "Use the Python MiniLB").Ignored = true
	p.Bool(pd, "test-external-dp-routing", &o.ignoredBool, "MiniLB DP routing test").Ignored = true
	p.Bool(pd, "pd-disaggregation", &o.pd, "Enable PD (prefill-decode) disaggregated mode")
	p.Append(pd, "prefill", &o.prefill, false, "Prefill server: URL [BOOTSTRAP_PORT|none]; repeatable").Metavar = "URL"
	p.Append(pd, "decode", &o.decode, true, "Decode server URL; repeatable").Metavar = "URL"
	p.Int(pd, "worker-startup-timeout-secs", &o.startupTimeout, "Seconds to wait for each worker to become healthy")
	p.Int(pd, "worker-startup-check-interval", &o.startupInterval, "Seconds between startup checks (also the /get_load poll interval)")

	p.OptString(lg, "log-dir", &o.logDir, "Directory for log files (console only when unset)")
	p.String(lg, "log-level", &o.logLevel, "Log level", "debug", "info", "warn", "error")
	p.Bool(lg, "json-log", &o.jsonLog, "Structured JSON logs")

	const sd = "Service Discovery (Kubernetes)"
	p.Bool(sd, "service-discovery", &o.ignoredBool, "Kubernetes service discovery").Ignored = true
	p.Strings(sd, "selector", &o.ignoredList, true, "Pod label selector").Ignored = true
	p.Int(sd, "service-discovery-port", &o.ignoredInt, "Port of discovered pods").Ignored = true
	p.String(sd, "service-discovery-namespace", &o.ignoredString, "Namespace to watch").Ignored = true
	p.Strings(sd, "prefill-selector", &o.ignoredList, true, "Prefill pod selector").Ignored = true
	p.Strings(sd, "decode-selector", &o.ignoredList, true, "Decode pod selector").Ignored = true

	p.Int(pr, "prometheus-port", &o.promPort, "Port of the Prometheus metrics listener")
	p.String(pr, "prometheus-host", &o.promHost, "Host of the Prometheus metrics listener")
	p.Strings(pr, "prometheus-duration-buckets", &o.ignoredFloats, true, "Buckets for duration histograms")

	p.Strings(rq, "request-id-headers", &o.requestIDHeaders, false, "Headers checked for a client request id")
	p.Int(rq, "request-timeout-secs", &o.requestTimeout, "Total timeout of an upstream request, streaming included")
	p.Int(rq, "shutdown-grace-period-secs", &o.shutdownGrace, "Seconds to drain in-flight requests on SIGTERM")
	p.Strings(rq, "cors-allowed-origins", &o.cors, false, "CORS allowed origins (any when empty)")

	p.Int(rl, "max-concurrent-requests", &o.maxConcurrent, "Token bucket capacity; -1 disables admission control")
	p.Int(rl, "queue-size", &o.queueSize, "Requests that may wait for a token (0 = 429 at once)")
	p.Int(rl, "queue-timeout-secs", &o.queueTimeout, "Seconds a request may wait in the queue (then 408)")
	p.OptString(rl, "rate-limit-tokens-per-second", &o.rateLimit, "Token refill rate (default: max-concurrent-requests)")

	p.Int(rt, "retry-max-retries", &o.retryMax, "Attempts in total")
	p.Int(rt, "retry-initial-backoff-ms", &o.retryInitial, "Backoff before the first retry")
	p.Int(rt, "retry-max-backoff-ms", &o.retryMaxMS, "Longest backoff")
	p.Float(rt, "retry-backoff-multiplier", &o.retryMult, "Backoff growth per attempt")
	p.Float(rt, "retry-jitter-factor", &o.retryJitter, "Random jitter (0.0-1.0) of each backoff")
	p.Bool(rt, "disable-retries", &o.disableRetries, "One attempt only")

	p.Int(cb, "cb-failure-threshold", &o.cbFail, "Consecutive failures that open a worker's circuit")
	p.Int(cb, "cb-success-threshold", &o.cbSuccess, "Half-open successes that close it")
	p.Int(cb, "cb-timeout-duration-secs", &o.cbTimeout, "Seconds open before half-open")
	p.Int(cb, "cb-window-duration-secs", &o.cbWindow, "Validated but unused, as in sglang-router")
	p.Bool(cb, "disable-circuit-breaker", &o.disableCB, "Never open circuits")

	p.Int(hc, "health-failure-threshold", &o.healthFail, "Consecutive failed checks before a worker is unhealthy")
	p.Int(hc, "health-success-threshold", &o.healthSuccess, "Consecutive passed checks before it is healthy again")
	p.Int(hc, "health-check-timeout-secs", &o.healthTimeout, "Timeout of one health check")
	p.Int(hc, "health-check-interval-secs", &o.healthInterval, "Seconds between health checks")
	p.String(hc, "health-check-endpoint", &o.healthEndpoint, "Health check path")
	p.Bool(hc, "disable-health-check", &o.disableHealth, "No health checks; workers stay healthy")

	// Features of the gRPC/OpenAI-gateway flavour that pdrouter does not
	// implement: accepted so existing launch scripts keep working.
	const tk, ps, be, db, tls, tr, au = "Tokenizer", "Parsers", "Backend", "History Storage", "TLS/mTLS Security",
		"Tracing (OpenTelemetry)", "Control Plane Authentication"
	for _, f := range []struct{ group, name string }{
		{tk, "model-path"}, {tk, "tokenizer-path"}, {tk, "chat-template"}, {tk, "tokenizer-cache-l0-max-entries"},
		{tk, "tokenizer-cache-l1-max-memory"}, {ps, "reasoning-parser"}, {ps, "tool-call-parser"}, {ps, "mcp-config-path"},
		{be, "backend"}, {be, "history-backend"}, {db, "oracle-wallet-path"}, {db, "oracle-tns-alias"},
		{db, "oracle-connect-descriptor"}, {db, "oracle-username"}, {db, "oracle-password"}, {db, "oracle-pool-min"},
		{db, "oracle-pool-max"}, {db, "oracle-pool-timeout-secs"}, {db, "postgres-db-url"}, {db, "postgres-pool-max"},
		{db, "redis-url"}, {db, "redis-pool-max"}, {db, "redis-retention-days"}, {tls, "client-cert-path"},
		{tls, "client-key-path"}, {tls, "tls-cert-path"}, {tls, "tls-key-path"}, {tr, "otlp-traces-endpoint"},
		{au, "jwt-issuer"}, {au, "jwt-audience"}, {au, "jwt-jwks-uri"},
	} {
		p.OptString(f.group, f.name, &o.ignoredOpt, "").Ignored = true
	}
	p.OptString(au, "api-key", &o.apiKey, "API key: clients must send it as a Bearer token; also used towards workers")
	p.Bool(tk, "tokenizer-cache-enable-l0", &o.ignoredBool, "").Ignored = true
	p.Bool(tk, "tokenizer-cache-enable-l1", &o.ignoredBool, "").Ignored = true
	p.Strings(tls, "ca-cert-paths", &o.ignoredList, false, "").Ignored = true
	p.Bool(tr, "enable-trace", &o.ignoredBool, "").Ignored = true
	p.Strings(au, "control-plane-api-keys", &o.ignoredList, false, "").Ignored = true
	p.Bool(au, "control-plane-audit-enabled", &o.ignoredBool, "").Ignored = true
	p.Strings(au, "jwt-role-mapping", &o.ignoredList, false, "").Ignored = true
	return p, o
}

func secs(n int) time.Duration { return time.Duration(n) * time.Second }

// config turns parsed options into a router.Config, with sglang-router's
// validation ("Configuration validation failed: ...").
func (o *options) config() (router.Config, error) {
	cfg := router.DefaultConfig()
	cfg.Host, cfg.Port = o.host, o.port
	cfg.PDDisaggregation = o.pd
	if !o.pd {
		cfg.WorkerURLs = o.workerURLs
	}
	for _, args := range o.prefill {
		spec := router.PrefillSpec{URL: args[0], BootstrapPort: balancer.NoBootstrapPort}
		if len(args) >= 2 && !strings.EqualFold(args[1], "none") {
			port, err := strconv.Atoi(args[1])
			if err != nil {
				return cfg, fmt.Errorf("Invalid bootstrap port: %s. Must be a number or 'none'", args[1])
			}
			if port <= 0 || port > 65535 {
				return cfg, invalid("bootstrap port %d of %s must be in 1..65535", port, args[0])
			}
			spec.BootstrapPort = port
		}
		cfg.Prefill = append(cfg.Prefill, spec)
	}
	for _, args := range o.decode {
		cfg.Decode = append(cfg.Decode, args[0])
	}
	cfg.Policy = o.policy
	if o.prefillPolicy != nil {
		cfg.PrefillPolicy = *o.prefillPolicy
	}
	if o.decodePolicy != nil {
		cfg.DecodePolicy = *o.decodePolicy
	}
	cfg.PolicyOptions = balancer.PolicyOptions{
		CacheThreshold:       o.cacheThreshold,
		BalanceAbsThreshold:  int64(o.balanceAbs),
		BalanceRelThreshold:  o.balanceRel,
		EvictionInterval:     secs(o.evictionInterval),
		MaxTreeSize:          int64(o.maxTreeSize),
		MaxIdle:              secs(o.maxIdle),
		AssignmentMode:       o.assignmentMode,
		BucketAdjustInterval: secs(o.bucketAdjust),
	}
	cfg.MaxPayloadSize = o.maxPayload
	if o.apiKey != nil {
		cfg.APIKey = *o.apiKey
	}
	if len(o.requestIDHeaders) > 0 {
		cfg.RequestIDHeaders = o.requestIDHeaders
	}
	cfg.RequestTimeout = secs(o.requestTimeout)
	cfg.ShutdownGrace = secs(o.shutdownGrace)
	cfg.CORSOrigins = o.cors
	cfg.PrometheusHost, cfg.PrometheusPort = o.promHost, o.promPort

	cfg.Admission = balancer.AdmissionConfig{MaxConcurrent: o.maxConcurrent, QueueSize: o.queueSize, QueueTimeout: secs(o.queueTimeout)}
	if o.rateLimit != nil {
		rate, err := strconv.ParseFloat(*o.rateLimit, 64)
		if err != nil || rate <= 0 {
			return cfg, invalid("rate_limit_tokens_per_second must be a positive number, got %q", *o.rateLimit)
		}
		cfg.Admission.RatePerSecond = rate
	}
	cfg.Retry = balancer.RetryConfig{MaxRetries: o.retryMax, InitialBackoff: time.Duration(o.retryInitial) * time.Millisecond,
		MaxBackoff: time.Duration(o.retryMaxMS) * time.Millisecond, Multiplier: o.retryMult, Jitter: o.retryJitter}
	if o.disableRetries {
		cfg.Retry.MaxRetries = 1
	}
	m := &cfg.Manager
	m.StartupTimeout, m.StartupInterval = secs(o.startupTimeout), secs(o.startupInterval)
	m.APIKey = cfg.APIKey
	m.Breaker = balancer.BreakerConfig{FailureThreshold: o.cbFail, SuccessThreshold: o.cbSuccess,
		OpenDuration: secs(o.cbTimeout), Disabled: o.disableCB}
	m.Health = balancer.HealthConfig{Endpoint: o.healthEndpoint, Interval: secs(o.healthInterval), Timeout: secs(o.healthTimeout),
		FailureThreshold: o.healthFail, SuccessThreshold: o.healthSuccess, Disabled: o.disableHealth}
	if usesPolicy(cfg, "power_of_two") {
		m.LoadPollInterval = m.StartupInterval
	}
	return cfg, o.validate(cfg)
}

func usesPolicy(cfg router.Config, name string) bool {
	return cfg.Policy == name || cfg.PrefillPolicy == name || cfg.DecodePolicy == name
}

func invalid(format string, args ...any) error {
	return fmt.Errorf("Configuration validation failed: "+format, args...)
}

// validate applies sglang-router's checks (src/config/validation.rs).
func (o *options) validate(cfg router.Config) error {
	urls := append([]string{}, cfg.WorkerURLs...)
	for _, p := range cfg.Prefill {
		urls = append(urls, p.URL)
	}
	urls = append(urls, cfg.Decode...)
	for _, u := range urls {
		scheme, rest, ok := strings.Cut(u, "://")
		if !ok || (scheme != "http" && scheme != "https" && scheme != "grpc") || rest == "" || rest[0] == '/' || rest[0] == ':' {
			return invalid("invalid worker URL %q: must start with http://, https:// or grpc:// and have a host", u)
		}
		if scheme == "grpc" {
			return invalid("worker URL %q: gRPC workers are not supported by pdrouter", u)
		}
	}
	checks := []struct {
		bad bool
		msg string
	}{
		{o.port <= 0 || o.port > 65535, "port must be in 1..65535"},
		{o.cacheThreshold < 0 || o.cacheThreshold > 1, "cache_threshold must be in [0, 1]"},
		{o.balanceRel < 1, "balance_rel_threshold must be >= 1.0"},
		{o.evictionInterval <= 0, "eviction_interval must be > 0"},
		{o.maxTreeSize <= 0, "max_tree_size must be > 0"},
		{o.retryMax < 1, "retry max_retries must be >= 1"},
		{o.retryInitial <= 0, "retry initial_backoff_ms must be > 0"},
		{o.retryMaxMS < o.retryInitial, "retry max_backoff_ms must be >= initial_backoff_ms"},
		{o.retryMult < 1, "retry backoff_multiplier must be >= 1"},
		{o.retryJitter < 0 || o.retryJitter > 1, "retry jitter_factor must be in [0, 1]"},
		{o.cbFail < 1 || o.cbSuccess < 1, "circuit breaker thresholds must be >= 1"},
		{o.cbTimeout <= 0 || o.cbWindow <= 0, "circuit breaker durations must be > 0"},
		{o.queueSize > 0 && o.queueTimeout <= 0, "queue_timeout_secs must be > 0 when queue_size > 0"},
		{o.queueSize < 0, "queue_size must be >= 0"},
		{o.requestTimeout <= 0, "request_timeout_secs must be > 0"},
		{o.startupTimeout <= 0 || o.startupInterval <= 0, "worker startup timeout and check interval must be > 0"},
		{o.healthFail < 1 || o.healthSuccess < 1, "health check thresholds must be >= 1"},
		{o.healthTimeout <= 0 || o.healthInterval <= 0, "health check timeout and interval must be > 0"},
		{o.maxPayload <= 0, "max_payload_size must be > 0"},
		{cfg.DecodePolicy == "bucket", "bucket is not allowed as the decode policy"},
	}
	for _, c := range checks {
		if c.bad {
			return invalid("%s", c.msg)
		}
	}
	// power_of_two needs two workers to compare (per side in PD mode).
	if cfg.PDDisaggregation {
		if pol := cmpOr(cfg.PrefillPolicy, cfg.Policy); pol == "power_of_two" && len(cfg.Prefill) == 1 {
			return invalid("power_of_two policy requires at least 2 prefill workers")
		}
		if pol := cmpOr(cfg.DecodePolicy, cfg.Policy); pol == "power_of_two" && len(cfg.Decode) == 1 {
			return invalid("power_of_two policy requires at least 2 decode workers")
		}
	} else if cfg.Policy == "power_of_two" && len(cfg.WorkerURLs) == 1 {
		return invalid("power_of_two policy requires at least 2 workers")
	}
	return nil
}

func cmpOr(a, b string) string {
	if a != "" {
		return a
	}
	return b
}
