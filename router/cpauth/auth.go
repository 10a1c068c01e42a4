// Package cpauth is the control plane's authentication, as sglang-router
// 0.3.x's (src/auth): API keys with roles, JWTs verified against an
// identity provider's JWKS, and the audit line of each admin call. The
// router asks one question, Authenticator.Check, and knows nothing else.
package cpauth

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"fmt"
	"strings"

	"go.uber.org/zap"
)

// Role is a control-plane role, as in sglang-router 0.3.x (src/auth/config.rs):
// admin may call the worker admin and management endpoints, user may not.
type Role string

const (
	RoleAdmin Role = "admin"
	RoleUser  Role = "user"
)

// ParseRole accepts admin or user in any case.
func ParseRole(s string) (Role, error) {
	switch r := Role(strings.ToLower(s)); r {
	case RoleAdmin, RoleUser:
		return r, nil
	}
	return "", fmt.Errorf("invalid role %q: must be 'admin' or 'user'", s)
}

// Key is one --control-plane-api-keys 'id:name:role:key'.
type Key struct {
	ID, Name string
	Role     Role
	Key      string
}

// ParseKey splits 'id:name:role:key' (the key may contain ':').
func ParseKey(s string) (Key, error) {
	parts := strings.SplitN(s, ":", 4)
	if len(parts) != 4 {
		return Key{}, fmt.Errorf("invalid API key format: %q. Expected 'id:name:role:key'", redact(s))
	}
	role, err := ParseRole(parts[2])
	if err != nil {
		return Key{}, err
	}
	return Key{ID: parts[0], Name: parts[1], Role: role, Key: parts[3]}, nil
}

// redact keeps an API key out of error messages: only its id is shown.
func redact(s string) string {
	id, _, _ := strings.Cut(s, ":")
	return id + ":..."
}

// ParseRoleMapping reads --jwt-role-mapping 'idp_role=gateway_role' entries.
func ParseRoleMapping(entries []string) (map[string]Role, error) {
	m := map[string]Role{}
	for _, e := range entries {
		idp, role, ok := strings.Cut(e, "=")
		if !ok {
			return nil, fmt.Errorf("invalid role mapping format: %q. Expected 'idp_role=gateway_role'", e)
		}
		r, err := ParseRole(role)
		if err != nil {
			return nil, fmt.Errorf("invalid gateway role in %q: %w", e, err)
		}
		m[idp] = r
	}
	return m, nil
}

// Config is 0.3.x's control-plane authentication: API keys and JWTs from
// an identity provider. When either is configured it replaces --api-key on
// the admin routes (/workers..., /flush_cache, /get_loads and the legacy
// worker routes) and requires the admin role.
type Config struct {
	APIKeys []Key
	JWT     *JWTConfig // nil = no JWT authentication
	// Audit logs every admin call: who, how authenticated, what, outcome.
	Audit bool
}

// Enabled reports whether the admin routes use control-plane auth.
func (a Config) Enabled() bool { return len(a.APIKeys) > 0 || a.JWT != nil }

// Validate reports the first rule a breaks; the router wraps it in its
// ConfigError.
func (a Config) Validate() error {
	ids := map[string]bool{}
	for _, k := range a.APIKeys {
		switch {
		case k.ID == "" || k.Key == "":
			return fmt.Errorf("control plane API key %q: id and key must not be empty", k.ID)
		case ids[k.ID]:
			return fmt.Errorf("control plane API key id %q given twice", k.ID)
		case k.Role != RoleAdmin && k.Role != RoleUser:
			return fmt.Errorf("control plane API key %q: role must be admin or user", k.ID)
		}
		ids[k.ID] = true
	}
	if a.JWT != nil {
		return a.JWT.validate()
	}
	return nil
}

// Principal is who made an admin call.
type Principal struct {
	ID     string
	Method string // api_key, jwt, router_api_key or none
	Role   Role
}

// Denied is why Check refused a call; its Status (401 or 403) and Message
// are the reply. RouterKey marks a refusal under the router's --api-key
// (no control-plane auth configured), which the router answers in its
// own error shape rather than as a bearer challenge.
type Denied struct {
	Status    int
	Message   string
	RouterKey bool
}

func (d *Denied) Error() string { return d.Message }

// Authenticator checks the Authorization header of admin calls.
type Authenticator struct {
	cfg       Config
	routerKey string     // --api-key, used while cfg is not Enabled
	keyHashes [][32]byte // SHA-256 of cfg.APIKeys, same order
	jwt       *jwtValidator
	log       *zap.Logger
}

// New builds an Authenticator for cfg (which must pass Validate), falling
// back to routerKey (--api-key, "" = none) when cfg configures nothing. A
// JWT configuration discovers its JWKS now (a failure is an error) and
// refreshes it until ctx ends.
func New(ctx context.Context, cfg Config, routerKey string, log *zap.Logger) (*Authenticator, error) {
	a := &Authenticator{cfg: cfg, routerKey: routerKey, log: log}
	for _, k := range cfg.APIKeys {
		a.keyHashes = append(a.keyHashes, sha256.Sum256([]byte(k.Key)))
	}
	if cfg.JWT != nil {
		var err error
		if a.jwt, err = newJWTValidator(ctx, *cfg.JWT, log); err != nil {
			return nil, err
		}
	}
	return a, nil
}

// Check authenticates an admin call by its Authorization header. The
// error is a *Denied; the Principal names the caller even then, for the
// audit line.
func (a *Authenticator) Check(ctx context.Context, authorization string) (Principal, error) {
	none := Principal{ID: "unauthenticated", Method: "none", Role: RoleUser}
	if !a.cfg.Enabled() {
		// As 0.3.x: without control-plane auth the admin routes take --api-key.
		switch {
		case a.routerKey == "":
			return Principal{ID: "anonymous", Method: "none", Role: RoleAdmin}, nil
		case len(authorization) > 7 && strings.EqualFold(authorization[:7], "Bearer ") && authorization[7:] == a.routerKey:
			return Principal{ID: "api-key", Method: "router_api_key", Role: RoleAdmin}, nil
		}
		return none, &Denied{Status: 401, Message: "missing or invalid API key", RouterKey: true}
	}
	token, ok := strings.CutPrefix(authorization, "Bearer ")
	if !ok || token == "" {
		return none, &Denied{Status: 401, Message: "Missing or invalid Authorization header"}
	}
	if a.jwt != nil {
		claims, err := a.jwt.validate(ctx, token)
		if err == nil {
			return admin(Principal{ID: claims.subject, Method: "jwt", Role: claims.role})
		}
		// A token shaped like a JWT is an invalid JWT, not an API key (as 0.3.x).
		if strings.Count(token, ".") == 2 {
			a.log.Warn("control plane: invalid JWT", zap.Error(err))
			return none, &Denied{Status: 401, Message: "Invalid JWT: " + err.Error()}
		}
	}
	if k := a.findKey(token); k != nil {
		return admin(Principal{ID: k.ID, Method: "api_key", Role: k.Role})
	}
	return none, &Denied{Status: 401, Message: "Invalid authentication token"}
}

// findKey compares SHA-256 digests in constant time and looks at every
// key, so timing tells nothing about which (if any) matched.
func (a *Authenticator) findKey(token string) *Key {
	sum := sha256.Sum256([]byte(token))
	var found *Key
	for i := range a.keyHashes {
		if subtle.ConstantTimeCompare(sum[:], a.keyHashes[i][:]) == 1 {
			found = &a.cfg.APIKeys[i]
		}
	}
	return found
}

func admin(p Principal) (Principal, error) {
	if p.Role == RoleAdmin {
		return p, nil
	}
	return p, &Denied{Status: 403, Message: "Admin role required for control plane access"}
}

// Call is what the audit line says about one admin call.
type Call struct {
	Method, Path, RequestID string
	Status                  int
	Allowed                 bool
}

// Audit logs one admin call with --control-plane-audit-enabled; without
// it, it does nothing.
func (a *Authenticator) Audit(p Principal, c Call) {
	if !a.cfg.Audit {
		return
	}
	outcome := "success"
	if !c.Allowed {
		outcome = "denied"
	}
	a.log.Info("control_plane_audit",
		zap.String("principal", auditField(p.ID)),
		zap.String("auth_method", p.Method),
		zap.String("role", string(p.Role)),
		zap.String("method", c.Method),
		zap.String("path", auditField(c.Path)),
		zap.String("outcome", outcome),
		zap.Int("status", c.Status),
		zap.String("request_id", auditField(c.RequestID)))
}

// maxAuditField bounds what a client can put in one audit line.
const maxAuditField = 1024

func auditField(s string) string {
	if len(s) > maxAuditField {
		return s[:maxAuditField] + "...[TRUNCATED]"
	}
	return s // zap escapes control characters: no log injection
}
