package main

import (
	"errors"
	"strings"
	"testing"

	"github.com/pdrouter/pdrouter/balancer"
	"github.com/pdrouter/pdrouter/router"
)

// vllm-router's launch line: --vllm-pd-disaggregation alone turns PD mode
// on, and a --prefill without a port has none.
func TestVLLMPDFlags(t *testing.T) {
	cfg, err := parse(t, "--vllm-pd-disaggregation", "--prefill", "http://p1:8100", "--prefill", "http://p2:8100", "9000",
		"--decode", "http://d1:8200", "--prefill-policy", "cache_aware", "--decode-policy", "round_robin").config()
	if err != nil {
		t.Fatal(err)
	}
	want := []router.PrefillSpec{{URL: "http://p1:8100", BootstrapPort: balancer.NoBootstrapPort}, {URL: "http://p2:8100", BootstrapPort: 9000}}
	if !cfg.VLLMPDDisaggregation || !cfg.PDDisaggregation || len(cfg.Prefill) != 2 || cfg.Prefill[0] != want[0] || cfg.Prefill[1] != want[1] ||
		len(cfg.Decode) != 1 || cfg.PrefillPolicy != "cache_aware" || cfg.DecodePolicy != "round_robin" {
		t.Errorf("config %+v", cfg)
	}
	if cfg, err := parse(t).config(); err != nil || cfg.VLLMPDDisaggregation {
		t.Errorf("vLLM mode on by default (%v)", err)
	}
}

// A Config built in Go must say PD too.
func TestVLLMPDNeedsPD(t *testing.T) {
	cfg := router.DefaultConfig()
	cfg.VLLMPDDisaggregation = true
	var ce *router.ConfigError
	if err := cfg.Validate(); !errors.As(err, &ce) {
		t.Errorf("Validate: %v, want a ConfigError", err)
	}
	cfg.PDDisaggregation = true
	if err := cfg.Validate(); err != nil {
		t.Error(err)
	}
}

// vllm-router's --kv-connector: nixl, its default, is what pdrouter does;
// the connectors whose ids the router would mint are refused, exit 2.
func TestKVConnectorFlag(t *testing.T) {
	if _, err := parse(t, "--vllm-pd-disaggregation", "--kv-connector", "nixl", "--prefill", "http://p:1", "--decode", "http://d:1").config(); err != nil {
		t.Error(err)
	}
	for _, c := range []string{"mooncake", "moriio"} {
		args := []string{"--vllm-pd-disaggregation", "--kv-connector", c, "--prefill", "http://p:1", "--decode", "http://d:1"}
		var ce *router.ConfigError
		if _, err := parse(t, args...).config(); !errors.As(err, &ce) || !strings.Contains(err.Error(), "kv_connector "+c) {
			t.Errorf("%s: %v", c, err)
		}
		if code := run(args); code != 2 {
			t.Errorf("%s: exit status %d, want 2", c, code)
		}
	}
}
