package main

import (
	"slices"
	"strings"
	"testing"
)

// --dp-aware is implemented (balancer.ManagerConfig.DPAware), no longer
// accepted-and-ignored.
func TestDPAwareFlag(t *testing.T) {
	cfg, err := parse(t, "--dp-aware", "--worker-urls", "http://w:30000").config()
	if err != nil || !cfg.Manager.DPAware {
		t.Fatalf("DPAware %v, %v", cfg.Manager.DPAware, err)
	}
	if cfg, _ := parse(t).config(); cfg.Manager.DPAware {
		t.Error("DPAware on by default")
	}
	p, _ := newParser()
	if err := p.Parse([]string{"--dp-aware"}); err != nil {
		t.Fatal(err)
	}
	if slices.ContainsFunc(p.Ignored(), func(s string) bool { return strings.Contains(s, "dp-aware") }) {
		t.Errorf("--dp-aware still listed as ignored: %v", p.Ignored())
	}
}
