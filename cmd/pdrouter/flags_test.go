package main

import (
	"bytes"
	"errors"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/pdrouter/pdrouter/balancer"
	"github.com/pdrouter/pdrouter/router"
)

func parse(t *testing.T, args ...string) *options {
	t.Helper()
	p, o := newParser()
	if err := p.Parse(args); err != nil {
		t.Fatalf("%v: %v", args, err)
	}
	return o
}

// With no flags the CLI's Config is router.DefaultConfig: the flags hold no
// defaults of their own.
func TestFlagDefaultsAreDefaultConfig(t *testing.T) {
	cfg, err := parse(t).config()
	if err != nil {
		t.Fatal(err)
	}
	if want := router.DefaultConfig(); !reflect.DeepEqual(cfg, want) {
		t.Errorf("CLI defaults differ from router.DefaultConfig:\n got %+v\nwant %+v", cfg, want)
	}
}

func TestFlagsFillConfig(t *testing.T) {
	cfg, err := parse(t, "--pd-disaggregation", "--prefill", "http://p1:30000", "8998", "--prefill", "http://p2:30000", "none",
		"--decode", "http://d1:30000", "--worker-urls", "http://ignored:1", "--prefill-policy", "bucket",
		"--max-tree-size", "8589934592", "--eviction-interval-secs", "7", "--retry-initial-backoff-ms", "20",
		"--rate-limit-tokens-per-second", "2.5", "--disable-retries", "--api-key", "k", "--request-id-headers",
		"--disable-circuit-breaker", "--health-check-interval-secs", "9").config()
	if err != nil {
		t.Fatal(err)
	}
	wantPrefill := []router.PrefillSpec{{URL: "http://p1:30000", BootstrapPort: 8998}, {URL: "http://p2:30000", BootstrapPort: balancer.NoBootstrapPort}}
	if !cfg.PDDisaggregation || !reflect.DeepEqual(cfg.Prefill, wantPrefill) || len(cfg.Decode) != 1 || cfg.WorkerURLs != nil {
		t.Errorf("workers: pd %v prefill %+v decode %v regular %v", cfg.PDDisaggregation, cfg.Prefill, cfg.Decode, cfg.WorkerURLs)
	}
	po, m := cfg.PolicyOptions, cfg.Manager
	if cfg.PrefillPolicy != "bucket" || po.MaxTreeSize != 1<<33 || po.EvictionInterval != 7*time.Second {
		t.Errorf("policy: %q %+v", cfg.PrefillPolicy, po)
	}
	if cfg.Retry.InitialBackoff != 20*time.Millisecond || cfg.Retry.MaxRetries != 1 || cfg.Admission.RatePerSecond != 2.5 {
		t.Errorf("retry %+v admission %+v", cfg.Retry, cfg.Admission)
	}
	if cfg.APIKey != "k" || m.APIKey != "k" || !m.Breaker.Disabled || m.Health.Interval != 9*time.Second {
		t.Errorf("api key %q/%q, manager %+v", cfg.APIKey, m.APIKey, m)
	}
	if !reflect.DeepEqual(cfg.RequestIDHeaders, router.DefaultConfig().RequestIDHeaders) {
		t.Errorf("a bare --request-id-headers dropped the defaults: %v", cfg.RequestIDHeaders)
	}
}

// Every command line the CLI rejects for its values builds a Config that
// router.New rejects with the same message, and run exits 2 on it.
func TestCLIAndValidateAgree(t *testing.T) {
	for _, args := range [][]string{
		{"--worker-urls", "ftp://w"},
		{"--worker-urls", "grpc://w:1"},
		{"--port", "0"},
		{"--cache-threshold", "2"},
		{"--balance-rel-threshold", "0.5"},
		{"--eviction-interval-secs", "0"},
		{"--max-tree-size", "-1"},
		{"--retry-max-retries", "0"},
		{"--retry-initial-backoff-ms", "100", "--retry-max-backoff-ms", "50"},
		{"--retry-backoff-multiplier", "0.9"},
		{"--retry-jitter-factor", "-0.1"},
		{"--cb-failure-threshold", "0"},
		{"--cb-timeout-duration-secs", "0"},
		{"--queue-size", "-1"},
		{"--queue-timeout-secs", "0"},
		{"--request-timeout-secs", "0"},
		{"--worker-startup-timeout-secs", "0"},
		{"--health-success-threshold", "0"},
		{"--health-check-timeout-secs", "0"},
		{"--max-payload-size", "0"},
		{"--prometheus-port", "-1"},
		{"--pd-disaggregation", "--prefill", "http://p:1", "0", "--decode", "http://d:1"},
		{"--policy", "power_of_two", "--worker-urls", "http://w:1"},
		{"--pd-disaggregation", "--prefill", "http://p:1", "--decode", "http://d:1", "--decode", "http://e:1", "--prefill-policy", "power_of_two"},
	} {
		cliErr := func() error { _, err := parse(t, args...).config(); return err }()
		var ce *router.ConfigError
		if !errors.As(cliErr, &ce) {
			t.Errorf("%v: the CLI accepted it (%v)", args, cliErr)
			continue
		}
		cfg, err := parse(t, args...).build()
		if err != nil {
			t.Fatalf("%v: build: %v", args, err)
		}
		if _, err := router.New(cfg, zap.NewNop(), prometheus.NewRegistry()); err == nil || err.Error() != cliErr.Error() {
			t.Errorf("%v: CLI says %q, router.New says %v", args, cliErr, err)
		}
		if code := run(args); code != 2 {
			t.Errorf("%v: exit status %d, want 2", args, code)
		}
	}
}

// The CLI's own checks, for what no Config field holds, also exit 2.
func TestCLIRejectsUnparsableValues(t *testing.T) {
	for args, want := range map[string]string{
		"--rate-limit-tokens-per-second 0":                                 "rate_limit_tokens_per_second must be a positive number",
		"--rate-limit-tokens-per-second abc":                               "rate_limit_tokens_per_second must be a positive number",
		"--cb-window-duration-secs 0":                                      "circuit breaker durations must be > 0",
		"--pd-disaggregation --prefill http://p:1 abc --decode http://d:1": "Invalid bootstrap port: abc",
	} {
		_, err := parse(t, strings.Fields(args)...).config()
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: got %v, want %q", args, err, want)
		}
		if code := run(strings.Fields(args)); code != 2 {
			t.Errorf("%s: exit status %d, want 2", args, code)
		}
	}
}

// The balancer's policy table gives --policy, --prefill-policy and
// --decode-policy their choices and --help its descriptions.
func TestPolicyTableDrivesFlags(t *testing.T) {
	p, _ := newParser()
	var b bytes.Buffer
	p.Help(&b)
	help := b.String()
	for flag, names := range map[string][]string{
		"policy": balancer.PolicyNames(false), "prefill-policy": balancer.PolicyNames(true), "decode-policy": balancer.PolicyNames(false),
	} {
		if want := "--" + flag + " {" + strings.Join(names, ",") + "}\n"; !strings.Contains(help, want) {
			t.Errorf("help lacks %q", want)
		}
	}
	for _, pol := range balancer.Policies() {
		if !strings.Contains(help, "        "+pol.Name+": "+pol.Summary+"\n") {
			t.Errorf("help does not describe %s", pol.Name)
		}
		for flag, prefillSide := range map[string]bool{"--policy": false, "--prefill-policy": true, "--decode-policy": false} {
			p, _ := newParser()
			err := p.Parse([]string{flag, pol.Name})
			if accepted := err == nil; accepted != (prefillSide || !pol.PrefillOnly) {
				t.Errorf("%s %s: %v", flag, pol.Name, err)
			}
		}
	}
}
