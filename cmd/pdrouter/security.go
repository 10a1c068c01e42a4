package main

import (
	"fmt"
	"strings"

	"github.com/pdrouter/pdrouter/internal/cli"
	"github.com/pdrouter/pdrouter/router"
	"github.com/pdrouter/pdrouter/router/cpauth"
)

// securityOptions are launch_router's "TLS/mTLS Security" and "Control
// Plane Authentication" flags (0.3.x), and the flags pdrouter refuses
// rather than ignore.
type securityOptions struct {
	tlsCert, tlsKey                 string
	clientCert, clientKey           string
	caCerts                         []string
	cpKeys                          []string
	audit                           bool
	jwtIssuer, jwtAudience, jwtJWKS *string
	jwtRoles                        []string
	backend                         *string
	enableIGW                       bool
}

func addSecurityFlags(p *cli.Parser, o *securityOptions) {
	const tls, au, be, r = "TLS/mTLS Security", "Control Plane Authentication", "Backend", "Routing Policy"
	p.String(tls, "tls-cert-path", &o.tlsCert, "Serve HTTPS with this PEM certificate (reloaded when the file changes)")
	p.String(tls, "tls-key-path", &o.tlsKey, "PEM private key of --tls-cert-path")
	p.String(tls, "client-cert-path", &o.clientCert, "PEM client certificate presented to https workers (mTLS)")
	p.String(tls, "client-key-path", &o.clientKey, "PEM private key of --client-cert-path")
	p.Strings(tls, "ca-cert-paths", &o.caCerts, false, "PEM CA bundles trusted for https workers, besides the system roots")
	p.Strings(au, "control-plane-api-keys", &o.cpKeys, false,
		"Admin API keys 'id:name:role:key' (role admin or user); they replace --api-key on the worker admin routes").Metavar = "KEY"
	p.Bool(au, "control-plane-audit-enabled", &o.audit, "Log every worker admin call: who, how authenticated, what, outcome")
	p.OptString(au, "jwt-issuer", &o.jwtIssuer, "OIDC issuer of admin JWTs (checked against iss)")
	p.OptString(au, "jwt-audience", &o.jwtAudience, "Expected aud of admin JWTs")
	p.OptString(au, "jwt-jwks-uri", &o.jwtJWKS, "JWKS URI (default: discovered from the issuer)")
	p.Strings(au, "jwt-role-mapping", &o.jwtRoles, false, "IdP role or group to gateway role: 'idp_role=admin|user'").Metavar = "MAPPING"
	p.OptString(be, "backend", &o.backend, "Backend runtime; pdrouter routes to SGLang workers only", "sglang", "openai")
	p.Bool(r, "enable-igw", &o.enableIGW, "Multi-model gateway mode (not implemented by pdrouter: start-up fails)")
}

// apply fills cfg's TLS and control-plane fields; cfg.Validate checks them.
func (o *securityOptions) apply(cfg *router.Config) error {
	cfg.TLSCertPath, cfg.TLSKeyPath = o.tlsCert, o.tlsKey
	cfg.WorkerTLS.CACertPaths = o.caCerts
	cfg.WorkerTLS.ClientCertPath, cfg.WorkerTLS.ClientKeyPath = o.clientCert, o.clientKey
	cp := &cfg.ControlPlane
	cp.Audit = o.audit
	for _, s := range o.cpKeys {
		k, err := cpauth.ParseKey(s)
		if err != nil {
			return &router.ConfigError{Rule: err.Error()}
		}
		cp.APIKeys = append(cp.APIKeys, k)
	}
	if o.jwtIssuer == nil && o.jwtAudience == nil {
		if o.jwtJWKS != nil || len(o.jwtRoles) > 0 {
			return &router.ConfigError{Rule: "--jwt-jwks-uri and --jwt-role-mapping need --jwt-issuer and --jwt-audience"}
		}
		return nil
	}
	// Unlike 0.3.x, half a JWT configuration fails instead of turning JWT off.
	roles, err := cpauth.ParseRoleMapping(o.jwtRoles)
	if err != nil {
		return &router.ConfigError{Rule: err.Error()}
	}
	cp.JWT = &cpauth.JWTConfig{Issuer: deref(o.jwtIssuer), Audience: deref(o.jwtAudience), JWKSURI: deref(o.jwtJWKS), RoleMapping: roles}
	return nil
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

// unimplemented names the flags given that would change where requests go
// or who may send them, which pdrouter does not implement: it refuses to
// start rather than run with less than was asked.
func (o *securityOptions) unimplemented() error {
	var refused []string
	if o.enableIGW {
		refused = append(refused, "--enable-igw (multi-model gateway routing)")
	}
	if o.backend != nil && *o.backend != "sglang" {
		refused = append(refused, "--backend "+*o.backend+" (only SGLang workers)")
	}
	if len(refused) == 0 {
		return nil
	}
	return fmt.Errorf("not implemented by pdrouter, refusing to start rather than ignore it: %s", strings.Join(refused, ", "))
}
