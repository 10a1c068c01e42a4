package main

import (
	"errors"
	"strings"
	"testing"

	"github.com/pdrouter/pdrouter/router"
	"github.com/pdrouter/pdrouter/router/cpauth"
)

func parseSecurity(t *testing.T, args string) (router.Config, error) {
	t.Helper()
	p, o := newParser()
	if err := p.Parse(strings.Fields(args)); err != nil {
		t.Fatalf("%s: %v", args, err)
	}
	return o.config()
}

func TestSecurityFlagsReachTheConfig(t *testing.T) {
	cfg, err := parseSecurity(t, "--tls-cert-path c.pem --tls-key-path k.pem --ca-cert-paths a.pem b.pem "+
		"--client-cert-path cc.pem --client-key-path ck.pem --control-plane-api-keys ops:Ops:admin:s:e:c ro:RO:USER:r "+
		"--control-plane-audit-enabled --jwt-issuer https://idp --jwt-audience gw --jwt-role-mapping G.Admin=admin")
	if err != nil {
		t.Fatal(err)
	}
	cp := cfg.ControlPlane
	switch {
	case cfg.TLSCertPath != "c.pem" || cfg.TLSKeyPath != "k.pem":
		t.Errorf("front TLS %q %q", cfg.TLSCertPath, cfg.TLSKeyPath)
	case len(cfg.WorkerTLS.CACertPaths) != 2 || cfg.WorkerTLS.ClientCertPath != "cc.pem" || cfg.WorkerTLS.ClientKeyPath != "ck.pem":
		t.Errorf("worker TLS %+v", cfg.WorkerTLS)
	case len(cp.APIKeys) != 2 || cp.APIKeys[0].Key != "s:e:c" || cp.APIKeys[1].Role != cpauth.RoleUser || !cp.Audit:
		t.Errorf("control plane %+v", cp)
	case cp.JWT == nil || cp.JWT.Issuer != "https://idp" || cp.JWT.Audience != "gw" || cp.JWT.RoleMapping["G.Admin"] != cpauth.RoleAdmin:
		t.Errorf("JWT %+v", cp.JWT)
	}
}

func TestSecurityFlagErrors(t *testing.T) {
	for _, args := range []string{
		"--tls-cert-path c.pem",
		"--client-key-path k.pem",
		"--control-plane-api-keys nocolons",
		"--control-plane-api-keys id:n:root:k",
		"--jwt-issuer https://idp",
		"--jwt-jwks-uri https://idp/keys",
		"--jwt-issuer https://idp --jwt-audience a --jwt-role-mapping nomapping",
	} {
		var ce *router.ConfigError
		if _, err := parseSecurity(t, args); err == nil {
			t.Errorf("%s: accepted", args)
		} else if !errors.As(err, &ce) {
			t.Errorf("%s: %T %v, want a ConfigError", args, err, err)
		}
		if code := run(strings.Fields(args)); code != 2 {
			t.Errorf("%s: exit %d, want 2", args, code)
		}
	}
}

func TestUnimplementedFlagsExit1(t *testing.T) {
	for _, args := range []string{"--enable-igw", "--backend openai"} {
		if code := run(strings.Fields(args)); code != 1 {
			t.Errorf("%s: exit %d, want 1", args, code)
		}
	}
	p, o := newParser()
	if err := p.Parse([]string{"--backend", "sglang"}); err != nil || o.security.unimplemented() != nil {
		t.Errorf("--backend sglang refused: %v", err)
	}
}
