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

// options are launch_router's flags (sglang-router 0.3.x, spec §1.3). Most
// bind straight to cfg, which starts as router.DefaultConfig, so the
// defaults --help shows are the router's; the rest need parsing first or
// only concern this command.
type options struct {
	cfg             router.Config
	prefill, decode [][]string
	rateLimit       *string
	disableRetries  bool
	cbWindow        time.Duration // validated but unused, as in sglang-router
	logDir          *string
	logLevel        string
	jsonLog         bool
	security        securityOptions
	discovery       discoveryOptions
	kvConnector     string // vllm-router's --kv-connector: only nixl's relay is implemented
	// accepted for compatibility only
	ignoredBool    bool
	ignoredOpt     *string
	ignoredList    []string
	ignoredFloats  []string
	ignoredAppends [][]string
}

func newParser() (*cli.Parser, *options) {
	o := &options{cfg: router.DefaultConfig(), cbWindow: 120 * time.Second, logLevel: "info", kvConnector: "nixl"}
	c, po, m := &o.cfg, &o.cfg.PolicyOptions, &o.cfg.Manager
	p := cli.New("pdrouter", "pdrouter: a drop-in for `python -m sglang_router.launch_router` (prefill/decode disaggregated and regular routing). The default port is 8000, not sglang-router's 30000.")
	const w, r, pd, lg, pr, rq, rl, rt, cb, hc = "Worker Configuration", "Routing Policy", "PD Disaggregation", "Logging",
		"Prometheus Metrics", "Request Handling", "Rate Limiting", "Retry Configuration", "Circuit Breaker", "Health Checks"
	p.String(w, "host", &c.Host, "Host address to bind the router server (IPv4 or IPv6)")
	p.Int(w, "port", &c.Port, "Port number to bind the router server")
	p.Strings(w, "worker-urls", &c.WorkerURLs, false, "Worker URLs for regular (non-PD) mode")

	p.String(r, "policy", &c.Policy, "Load balancing policy; in PD mode used for both sides unless overridden",
		balancer.PolicyNames(false)...).ChoiceHelp = policyHelp(false)
	p.String(r, "prefill-policy", &c.PrefillPolicy, "Policy for prefill workers in PD mode",
		balancer.PolicyNames(true)...).ChoiceHelp = policyHelp(true)
	p.String(r, "decode-policy", &c.DecodePolicy, "Policy for decode workers in PD mode", balancer.PolicyNames(false)...)
	p.Float(r, "cache-threshold", &po.CacheThreshold, "Prefix match ratio (0.0-1.0) above which cache_aware reuses a worker")
	p.Int64(r, "balance-abs-threshold", &po.BalanceAbsThreshold, "Absolute load difference that triggers balancing")
	p.Float(r, "balance-rel-threshold", &po.BalanceRelThreshold, "Relative load ratio that triggers balancing")
	p.Duration(r, "bucket-adjust-interval-secs", &po.BucketAdjustInterval, time.Second, "Seconds between bucket boundary adjustments")
	p.Duration(r, "eviction-interval-secs", &po.EvictionInterval, time.Second, "Seconds between cache tree evictions")
	p.Int64(r, "max-tree-size", &po.MaxTreeSize, "Bound of the cache_aware tree (bytes, over all workers)")
	p.Duration(r, "max-idle-secs", &po.MaxIdle, time.Second, "Idle seconds before a manual-policy routing key is evicted")
	p.String(r, "assignment-mode", &po.AssignmentMode, "How the manual policy assigns new routing keys", balancer.AssignmentModes()...)
	p.Int(r, "max-payload-size", &c.MaxPayloadSize, "Maximum request body in bytes (larger is a 413)")
	p.Bool(r, "dp-aware", &m.DPAware, "Route to each data-parallel rank of an engine as its own worker (dp_size from /server_info)")
	p.Bool(r, "upstream-http2", &m.UpstreamHTTP2, "Send requests over HTTP/2 cleartext (h2c, multiplexed) to each plain-http worker whose /server_info reports enable_http2; HTTP/1.1 to the others")
	p.Bool(r, "allow-requests-without-routing-key", &o.ignoredBool, "Allow keyless requests under consistent_hashing/manual").Ignored = true

	p.Bool(pd, "mini-lb", &o.ignoredBool, "Use the Python MiniLB").Ignored = true
	p.Bool(pd, "test-external-dp-routing", &o.ignoredBool, "MiniLB DP routing test").Ignored = true
	p.Bool(pd, "pd-disaggregation", &c.PDDisaggregation, "Enable PD (prefill-decode) disaggregated mode")
	p.Bool(pd, "vllm-pd-disaggregation", &c.VLLMPDDisaggregation, "Enable vLLM's PD mode (as vllm-router): prefill first with max_tokens 1, then decode with its kv_transfer_params")
	p.String(pd, "kv-connector", &o.kvConnector, "vLLM PD: the engines' KV connector; pdrouter relays the kv_transfer_params a prefill returns (NIXL's way), and supports nixl only", "nixl", "mooncake", "moriio")
	p.Append(pd, "prefill", &o.prefill, false, "Prefill server: URL [BOOTSTRAP_PORT|none]; repeatable").Metavar = "URL"
	p.Append(pd, "decode", &o.decode, true, "Decode server URL; repeatable").Metavar = "URL"
	p.Duration(pd, "worker-startup-timeout-secs", &m.StartupTimeout, time.Second, "Seconds to wait for each worker to become healthy")
	p.Duration(pd, "worker-startup-check-interval", &m.StartupInterval, time.Second, "Seconds between startup checks (also the /get_load poll interval)")

	p.OptString(lg, "log-dir", &o.logDir, "Directory for log files (console only when unset)")
	p.String(lg, "log-level", &o.logLevel, "Log level", "debug", "info", "warn", "error")
	p.Bool(lg, "json-log", &o.jsonLog, "Structured JSON logs")

	addDiscoveryFlags(p, &o.discovery)

	p.Int(pr, "prometheus-port", &c.PrometheusPort, "Port of the Prometheus metrics listener")
	p.String(pr, "prometheus-host", &c.PrometheusHost, "Host of the Prometheus metrics listener")
	p.Strings(pr, "prometheus-duration-buckets", &o.ignoredFloats, true, "Buckets for duration histograms").Ignored = true

	p.Strings(rq, "request-id-headers", &c.RequestIDHeaders, false, "Headers checked for a client request id")
	p.Duration(rq, "request-timeout-secs", &c.RequestTimeout, time.Second, "Total timeout of an upstream request, streaming included")
	p.Duration(rq, "engine-abort-timeout-ms", &c.AbortTimeout, time.Millisecond, "Bound on each POST /abort_request sent to an engine still holding a request whose client left or timed out (0: send none)")
	p.Duration(rq, "shutdown-grace-period-secs", &c.ShutdownGrace, time.Second, "Seconds to drain in-flight requests on SIGTERM")
	p.Strings(rq, "cors-allowed-origins", &c.CORSOrigins, false, "CORS allowed origins (any when empty)")
	p.Int(rq, "max-connections", &c.MaxConnections, "Open client connections at most; more are refused with a 503 (0: what the open-file limit holds, a client costing one descriptor more per leg to an HTTP/1.1 worker, less a reserve of 1/64)")
	p.Int(rq, "max-header-size", &c.MaxHeaderSize, "Largest request head in bytes (larger is a 431)")
	p.Duration(rq, "header-read-timeout-secs", &c.HeaderReadTimeout, time.Second, "Seconds a client has to send a request's head")
	p.Duration(rq, "body-read-timeout-secs", &c.BodyReadTimeout, time.Second, "Seconds a client has to send a request's body once its head is in")
	p.Int(rq, "event-loops", &c.EventLoops, "Event loops (epoll, Linux) serving regular mode's plain-HTTP non-streamed generations; anything else is served as before (0: none)")
	p.Duration(rq, "idle-connection-timeout-secs", &c.IdleConnectionTimeout, time.Second, "Seconds a keep-alive client connection may stay idle")
	p.Duration(rq, "stream-idle-timeout-secs", &c.StreamIdleTimeout, time.Second, "Seconds a stream may go without a byte from its worker after the first; then one SSE error event, and both legs end (0: never)")
	p.Duration(rq, "upstream-pool-idle-timeout-secs", &c.UpstreamIdleTimeout, time.Second, "Seconds a pooled worker connection may stay unused before the router closes it (keep below the engines' keep-alive, 5 s for SGLang)")

	p.Int(rl, "max-concurrent-requests", &c.Admission.MaxConcurrent, "Token bucket capacity; -1 disables admission control")
	p.Int(rl, "queue-size", &c.Admission.QueueSize, "Requests that may wait for a token (0 = 429 at once)")
	p.Duration(rl, "queue-timeout-secs", &c.Admission.QueueTimeout, time.Second, "Seconds a request may wait in the queue (then 408)")
	p.OptString(rl, "rate-limit-tokens-per-second", &o.rateLimit, "Token refill rate (default: max-concurrent-requests)")

	p.Int(rt, "retry-max-retries", &c.Retry.MaxRetries, "Attempts in total")
	p.Duration(rt, "retry-initial-backoff-ms", &c.Retry.InitialBackoff, time.Millisecond, "Backoff before the first retry")
	p.Duration(rt, "retry-max-backoff-ms", &c.Retry.MaxBackoff, time.Millisecond, "Longest backoff")
	p.Float(rt, "retry-backoff-multiplier", &c.Retry.Multiplier, "Backoff growth per attempt")
	p.Float(rt, "retry-jitter-factor", &c.Retry.Jitter, "Random jitter (0.0-1.0) of each backoff")
	p.Bool(rt, "disable-retries", &o.disableRetries, "One attempt only")

	p.Int(cb, "cb-failure-threshold", &m.Breaker.FailureThreshold, "Consecutive failures that open a worker's circuit")
	p.Int(cb, "cb-success-threshold", &m.Breaker.SuccessThreshold, "Half-open successes that close it")
	p.Duration(cb, "cb-timeout-duration-secs", &m.Breaker.OpenDuration, time.Second, "Seconds open before half-open")
	p.Duration(cb, "cb-window-duration-secs", &o.cbWindow, time.Second, "Validated but unused, as in sglang-router")
	p.Bool(cb, "disable-circuit-breaker", &m.Breaker.Disabled, "Never open circuits")
	p.Duration(cb, "outlier-first-byte-timeout-secs", &m.Breaker.StallTimeout, time.Second,
		"Seconds a worker may hold requests without a reply head, answering none and passing no health probe, before policies steer around it; with its probe failed too it is ejected (0: off)")
	p.Int(cb, "outlier-max-ejection-percent", &m.Breaker.MaxEjectionPercent,
		"No ejection while this share of a pool is ejected or unhealthy, as Envoy's max_ejection_percent (100: no cap)")
	p.Duration(cb, "outlier-max-ejection-time-secs", &m.Breaker.MaxOpenDuration, time.Second,
		"Longest ejection: each ejection in a row lasts --cb-timeout-duration-secs longer, up to this")

	p.Int(hc, "health-failure-threshold", &m.Health.FailureThreshold, "Consecutive failed checks before a worker is unhealthy")
	p.Int(hc, "health-success-threshold", &m.Health.SuccessThreshold, "Consecutive passed checks before it is healthy again")
	p.Duration(hc, "health-check-timeout-secs", &m.Health.Timeout, time.Second, "Timeout of one health check")
	p.Duration(hc, "health-check-interval-secs", &m.Health.Interval, time.Second, "Seconds between health checks")
	p.String(hc, "health-check-endpoint", &m.Health.Endpoint, "Health check path")
	p.Bool(hc, "disable-health-check", &m.Health.Disabled, "No health checks; workers stay healthy")

	// Features of the gRPC/OpenAI-gateway flavour that pdrouter does not
	// implement: accepted so existing launch scripts keep working.
	const tk, ps, be, db, tr, au = "Tokenizer", "Parsers", "Backend", "History Storage",
		"Tracing (OpenTelemetry)", "Control Plane Authentication"
	for _, f := range []struct{ group, name string }{
		{tk, "model-path"}, {tk, "tokenizer-path"}, {tk, "chat-template"}, {tk, "tokenizer-cache-l0-max-entries"},
		{tk, "tokenizer-cache-l1-max-memory"}, {ps, "reasoning-parser"}, {ps, "tool-call-parser"}, {ps, "mcp-config-path"},
		{be, "history-backend"}, {db, "oracle-wallet-path"}, {db, "oracle-tns-alias"},
		{db, "oracle-connect-descriptor"}, {db, "oracle-username"}, {db, "oracle-password"}, {db, "oracle-pool-min"},
		{db, "oracle-pool-max"}, {db, "oracle-pool-timeout-secs"}, {db, "postgres-db-url"}, {db, "postgres-pool-max"},
		{db, "redis-url"}, {db, "redis-pool-max"}, {db, "redis-retention-days"},
	} {
		p.OptString(f.group, f.name, &o.ignoredOpt, "").Ignored = true
	}
	p.String(au, "api-key", &c.APIKey, "API key: clients must send it as a Bearer token; also used towards workers")
	p.Bool(tk, "tokenizer-cache-enable-l0", &o.ignoredBool, "").Ignored = true
	p.Bool(tk, "tokenizer-cache-enable-l1", &o.ignoredBool, "").Ignored = true
	p.Bool(tr, "enable-trace", &c.Trace.Enabled, "Enable OpenTelemetry tracing: a span per request, W3C traceparent on both legs")
	p.String(tr, "otlp-traces-endpoint", &c.Trace.Endpoint, "OTLP/gRPC collector endpoint (host:port, or an http:// or https:// URL) if --enable-trace is set")
	addSecurityFlags(p, &o.security)
	return p, o
}

// policyHelp describes, from the balancer's policy table, the policies of
// --policy (all but the prefill-only ones) or those only --prefill-policy has.
func policyHelp(prefillOnly bool) map[string]string {
	help := map[string]string{}
	for _, p := range balancer.Policies() {
		if p.PrefillOnly == prefillOnly {
			help[p.Name] = p.Summary
		}
	}
	return help
}

// config finishes the Config and checks it with Config.Validate, as
// router.New will.
func (o *options) config() (router.Config, error) {
	cfg, err := o.build()
	if err != nil {
		return cfg, err
	}
	return cfg, cfg.Validate()
}

// build finishes the Config from the flags that need parsing; it rejects
// only what does not parse, and the checks of flags no Config field holds.
func (o *options) build() (router.Config, error) {
	cfg := o.cfg
	cfg.PDDisaggregation = cfg.PDDisaggregation || cfg.VLLMPDDisaggregation
	if cfg.PDDisaggregation {
		cfg.WorkerURLs = nil
	}
	for _, args := range o.prefill {
		spec := router.PrefillSpec{URL: args[0], BootstrapPort: balancer.NoBootstrapPort}
		if len(args) >= 2 && !strings.EqualFold(args[1], "none") {
			port, err := strconv.Atoi(args[1])
			if err != nil {
				return cfg, fmt.Errorf("Invalid bootstrap port: %s. Must be a number or 'none'", args[1])
			}
			spec.BootstrapPort = port
		}
		cfg.Prefill = append(cfg.Prefill, spec)
	}
	for _, args := range o.decode {
		cfg.Decode = append(cfg.Decode, args[0])
	}
	if len(cfg.RequestIDHeaders) == 0 { // a bare --request-id-headers keeps the default list
		cfg.RequestIDHeaders = router.DefaultConfig().RequestIDHeaders
	}
	if o.rateLimit != nil {
		rate, err := strconv.ParseFloat(*o.rateLimit, 64)
		if err != nil || rate <= 0 {
			return cfg, &router.ConfigError{Rule: fmt.Sprintf("rate_limit_tokens_per_second must be a positive number, got %q", *o.rateLimit)}
		}
		cfg.Admission.RatePerSecond = rate
	}
	if o.disableRetries {
		cfg.Retry.MaxRetries = 1
	}
	cfg.Manager.APIKey = cfg.APIKey
	if err := o.security.apply(&cfg); err != nil {
		return cfg, err
	}
	if o.kvConnector != "nixl" {
		return cfg, &router.ConfigError{Rule: "kv_connector " + o.kvConnector + " is not supported by pdrouter: only nixl (the prefill returns the kv_transfer_params the decode is sent)"}
	}
	if o.cbWindow <= 0 {
		return cfg, &router.ConfigError{Rule: "circuit breaker durations must be > 0"}
	}
	return cfg, nil
}
