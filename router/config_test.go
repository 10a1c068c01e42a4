package router

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/pdrouter/pdrouter/balancer"
)

func pdConfig(prefill, decode int) Config {
	c := DefaultConfig()
	c.PDDisaggregation = true
	for i := range prefill {
		c.Prefill = append(c.Prefill, PrefillSpec{URL: fmt.Sprintf("http://p%d:30000", i), BootstrapPort: 8998})
	}
	for i := range decode {
		c.Decode = append(c.Decode, fmt.Sprintf("http://d%d:30000", i))
	}
	return c
}

func TestConfigValidateAcceptsGoodConfigs(t *testing.T) {
	for name, c := range map[string]Config{
		"default":                DefaultConfig(),
		"regular workers":        func() Config { c := DefaultConfig(); c.WorkerURLs = []string{"http://w:1", "https://w2"}; return c }(),
		"pd":                     pdConfig(1, 1),
		"engine aborts off":      func() Config { c := pdConfig(1, 1); c.AbortTimeout = 0; return c }(),
		"pd, no bootstrap port":  func() Config { c := pdConfig(1, 1); c.Prefill[0].BootstrapPort = balancer.NoBootstrapPort; return c }(),
		"bucket on prefill":      func() Config { c := pdConfig(2, 1); c.PrefillPolicy = "bucket"; return c }(),
		"power_of_two, 2 a side": func() Config { c := pdConfig(2, 2); c.Policy = "power_of_two"; return c }(),
		"power_of_two, none yet": func() Config { c := DefaultConfig(); c.Policy = "power_of_two"; return c }(),
		// As 0.3.x: --policy counts both sides together.
		"power_of_two, 1P+1D": func() Config { c := pdConfig(1, 1); c.Policy = "power_of_two"; return c }(),
		"power_of_two, 1P+2D": func() Config { c := pdConfig(1, 2); c.Policy = "power_of_two"; return c }(),
		"one prefill, overridden": func() Config {
			c := pdConfig(1, 2)
			c.Policy, c.PrefillPolicy = "power_of_two", "random"
			return c
		}(),
		"pd ignores worker urls": func() Config {
			c := pdConfig(2, 2)
			c.Policy, c.WorkerURLs = "power_of_two", []string{"http://w:1"}
			return c
		}(),
		"no queue, no queue timeout": func() Config {
			c := DefaultConfig()
			c.Admission.QueueSize, c.Admission.QueueTimeout = 0, 0
			return c
		}(),
		"metrics off": func() Config { c := DefaultConfig(); c.PrometheusPort = 0; return c }(),
	} {
		if err := c.Validate(); err != nil {
			t.Errorf("%s: %v", name, err)
		}
	}
}

// Each rule: DefaultConfig (or a PD one) with one field wrong fails with a
// *ConfigError that names the field.
func TestConfigValidateRejectsEachBadField(t *testing.T) {
	for _, c := range []struct {
		want string
		pd   bool
		bad  func(*Config)
	}{
		{`invalid worker URL "ftp://w"`, false, func(c *Config) { c.WorkerURLs = []string{"ftp://w"} }},
		{`invalid worker URL "http://"`, false, func(c *Config) { c.WorkerURLs = []string{"http://"} }},
		{`invalid worker URL "http://:80"`, false, func(c *Config) { c.WorkerURLs = []string{"http://:80"} }},
		{`invalid worker URL "p:1"`, true, func(c *Config) { c.Prefill[0].URL = "p:1" }},
		{`invalid worker URL "//d"`, true, func(c *Config) { c.Decode[0] = "//d" }},
		{"gRPC workers are not supported", false, func(c *Config) { c.WorkerURLs = []string{"grpc://w:1"} }},
		{"bootstrap port 0 of http://p0:30000 must be in 1..65535", true, func(c *Config) { c.Prefill[0].BootstrapPort = 0 }},
		{"bootstrap port 65536 of", true, func(c *Config) { c.Prefill[0].BootstrapPort = 65536 }},
		{`unknown policy "fastest" (choose from random, round_robin,`, false, func(c *Config) { c.Policy = "fastest" }},
		{`unknown policy ""`, false, func(c *Config) { c.Policy = "" }},
		{"bucket is not allowed as the policy", false, func(c *Config) { c.Policy = "bucket" }},
		{`unknown prefill policy "x"`, true, func(c *Config) { c.PrefillPolicy = "x" }},
		{"bucket is not allowed as the decode policy", true, func(c *Config) { c.DecodePolicy = "bucket" }},
		{"power_of_two policy requires at least 2 workers", false, func(c *Config) {
			c.Policy, c.WorkerURLs = "power_of_two", []string{"http://w:1"}
		}},
		{"power_of_two policy requires at least 2 prefill workers", true, func(c *Config) { c.PrefillPolicy = "power_of_two" }},
		{"power_of_two policy requires at least 2 decode workers", true, func(c *Config) { c.DecodePolicy = "power_of_two" }},
		{"power_of_two policy requires at least 2 workers", true, func(c *Config) { c.Policy, c.Decode = "power_of_two", nil }},
		{"port must be in 1..65535", false, func(c *Config) { c.Port = 0 }},
		{"port must be in 1..65535", false, func(c *Config) { c.Port = 65536 }},
		{"prometheus_port must be in 0..65535", false, func(c *Config) { c.PrometheusPort = -1 }},
		{"cache_threshold must be in [0, 1]", false, func(c *Config) { c.PolicyOptions.CacheThreshold = 1.1 }},
		{"cache_threshold must be in [0, 1]", false, func(c *Config) { c.PolicyOptions.CacheThreshold = -0.1 }},
		{"balance_rel_threshold must be >= 1.0", false, func(c *Config) { c.PolicyOptions.BalanceRelThreshold = 0.9 }},
		{"eviction_interval must be > 0", false, func(c *Config) { c.PolicyOptions.EvictionInterval = 0 }},
		{"max_tree_size must be > 0", false, func(c *Config) { c.PolicyOptions.MaxTreeSize = 0 }},
		{"assignment_mode must be one of random, min_load, min_group", false, func(c *Config) { c.PolicyOptions.AssignmentMode = "max" }},
		{"retry max_retries must be >= 1", false, func(c *Config) { c.Retry.MaxRetries = 0 }},
		{"retry initial_backoff_ms must be > 0", false, func(c *Config) { c.Retry.InitialBackoff = 0 }},
		{"retry max_backoff_ms must be >= initial_backoff_ms", false, func(c *Config) { c.Retry.MaxBackoff = time.Millisecond }},
		{"retry backoff_multiplier must be >= 1", false, func(c *Config) { c.Retry.Multiplier = 0.5 }},
		{"retry jitter_factor must be in [0, 1]", false, func(c *Config) { c.Retry.Jitter = 1.5 }},
		{"circuit breaker thresholds must be >= 1", false, func(c *Config) { c.Manager.Breaker.FailureThreshold = 0 }},
		{"circuit breaker thresholds must be >= 1", false, func(c *Config) { c.Manager.Breaker.SuccessThreshold = 0 }},
		{"circuit breaker durations must be > 0", false, func(c *Config) { c.Manager.Breaker.OpenDuration = 0 }},
		{"queue_timeout_secs must be > 0 when queue_size > 0", false, func(c *Config) { c.Admission.QueueTimeout = 0 }},
		{"queue_size must be >= 0", false, func(c *Config) { c.Admission.QueueSize = -1 }},
		{"request_timeout_secs must be > 0", false, func(c *Config) { c.RequestTimeout = 0 }},
		{"abort_timeout_ms must be >= 0", false, func(c *Config) { c.AbortTimeout = -time.Millisecond }},
		{"worker startup timeout and check interval must be > 0", false, func(c *Config) { c.Manager.StartupTimeout = 0 }},
		{"worker startup timeout and check interval must be > 0", false, func(c *Config) { c.Manager.StartupInterval = -time.Second }},
		{"health check thresholds must be >= 1", false, func(c *Config) { c.Manager.Health.FailureThreshold = 0 }},
		{"health check thresholds must be >= 1", false, func(c *Config) { c.Manager.Health.SuccessThreshold = 0 }},
		{"health check timeout and interval must be > 0", false, func(c *Config) { c.Manager.Health.Timeout = 0 }},
		{"health check timeout and interval must be > 0", false, func(c *Config) { c.Manager.Health.Interval = 0 }},
		{"max_payload_size must be > 0", false, func(c *Config) { c.MaxPayloadSize = 0 }},
		{"max_connections must be >= 0", false, func(c *Config) { c.MaxConnections = -1 }},
		{"max_header_size must be >= 4096", false, func(c *Config) { c.MaxHeaderSize = 1024 }},
		{"header_read_timeout_secs", false, func(c *Config) { c.HeaderReadTimeout = 0 }},
		{"idle_connection_timeout_secs", false, func(c *Config) { c.IdleConnectionTimeout = 0 }},
		{"body_read_timeout_secs", false, func(c *Config) { c.BodyReadTimeout = 0 }},
	} {
		cfg := DefaultConfig()
		if c.pd {
			cfg = pdConfig(1, 1)
		}
		c.bad(&cfg)
		err := cfg.Validate()
		var ce *ConfigError
		if !errors.As(err, &ce) || !strings.Contains(ce.Rule, c.want) ||
			!strings.HasPrefix(err.Error(), "Configuration validation failed: ") {
			t.Errorf("want a ConfigError containing %q, got %v", c.want, err)
		}
	}
}

// router.New holds a Config built in Go to the same rules, before it
// registers any metric.
func TestNewRejectsInvalidConfig(t *testing.T) {
	reg := prometheus.NewRegistry()
	cfg := DefaultConfig()
	cfg.PolicyOptions.CacheThreshold = 2
	srv, err := New(cfg, zap.NewNop(), reg)
	var ce *ConfigError
	if srv != nil || !errors.As(err, &ce) || ce.Rule != "cache_threshold must be in [0, 1]" {
		t.Fatalf("New with a bad config: %v, %v", srv, err)
	}
	if mfs, err := reg.Gather(); err != nil || len(mfs) != 0 {
		t.Errorf("a rejected config registered %d metric families (%v)", len(mfs), err)
	}
}

// DefaultConfig hands out its own slices: changing one config's request id
// headers leaves the next default alone.
func TestDefaultConfigIsFresh(t *testing.T) {
	a := DefaultConfig()
	a.RequestIDHeaders[0] = "x-mine"
	if b := DefaultConfig(); b.RequestIDHeaders[0] != "x-request-id" {
		t.Fatalf("DefaultConfig shares its slice: %v", b.RequestIDHeaders)
	}
}
