package router

import (
	"crypto/sha256"
	"crypto/subtle"
	"fmt"
	"net/url"
	"strings"

	"github.com/valyala/fasthttp"
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

// ControlPlaneKey is one --control-plane-api-keys 'id:name:role:key'.
type ControlPlaneKey struct {
	ID, Name string
	Role     Role
	Key      string
}

// ParseControlPlaneKey splits 'id:name:role:key' (the key may contain ':').
func ParseControlPlaneKey(s string) (ControlPlaneKey, error) {
	parts := strings.SplitN(s, ":", 4)
	if len(parts) != 4 {
		return ControlPlaneKey{}, fmt.Errorf("invalid API key format: %q. Expected 'id:name:role:key'", redact(s))
	}
	role, err := ParseRole(parts[2])
	if err != nil {
		return ControlPlaneKey{}, err
	}
	return ControlPlaneKey{ID: parts[0], Name: parts[1], Role: role, Key: parts[3]}, nil
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

// ControlPlaneAuth is 0.3.x's control-plane authentication: API keys and
// JWTs from an identity provider. When either is configured it replaces
// --api-key on the admin routes (/workers..., /flush_cache, /get_loads and
// the legacy worker routes) and requires the admin role.
type ControlPlaneAuth struct {
	APIKeys []ControlPlaneKey
	JWT     *JWTConfig // nil = no JWT authentication
	// Audit logs every admin call: who, how authenticated, what, outcome.
	Audit bool
}

// Enabled reports whether the admin routes use control-plane auth.
func (a ControlPlaneAuth) Enabled() bool { return len(a.APIKeys) > 0 || a.JWT != nil }

func (a ControlPlaneAuth) validate() error {
	ids := map[string]bool{}
	for _, k := range a.APIKeys {
		switch {
		case k.ID == "" || k.Key == "":
			return invalid("control plane API key %q: id and key must not be empty", k.ID)
		case ids[k.ID]:
			return invalid("control plane API key id %q given twice", k.ID)
		case k.Role != RoleAdmin && k.Role != RoleUser:
			return invalid("control plane API key %q: role must be admin or user", k.ID)
		}
		ids[k.ID] = true
	}
	if a.JWT != nil {
		return a.JWT.validate()
	}
	return nil
}

// principal is who made an admin call.
type principal struct {
	id, method string // method: api_key, jwt, router_api_key or none
	role       Role
}

// controlPlane authenticates an admin call and, with --control-plane-audit-enabled,
// logs it once the handler has answered. It reports whether handle ran.
func (s *Server) controlPlane(ctx *fasthttp.RequestCtx, handle func()) bool {
	p, ok := s.authenticateAdmin(ctx)
	if ok {
		handle()
	}
	if s.cfg.ControlPlane.Audit {
		s.audit(ctx, p, ok)
	}
	return ok
}

// authenticateAdmin answers 401/403 itself when the call is refused.
func (s *Server) authenticateAdmin(ctx *fasthttp.RequestCtx) (principal, bool) {
	cp := s.cfg.ControlPlane
	none := principal{id: "unauthenticated", method: "none", role: RoleUser}
	if !cp.Enabled() {
		// As 0.3.x: without control-plane auth the admin routes take --api-key.
		switch {
		case s.cfg.APIKey == "":
			return principal{id: "anonymous", method: "none", role: RoleAdmin}, true
		case s.authorized(ctx):
			return principal{id: "api-key", method: "router_api_key", role: RoleAdmin}, true
		}
		return none, false
	}
	token, ok := strings.CutPrefix(string(ctx.Request.Header.Peek("Authorization")), "Bearer ")
	if !ok || token == "" {
		return none, unauthorized(ctx, "Missing or invalid Authorization header")
	}
	if s.jwt != nil {
		claims, err := s.jwt.validate(ctx, token)
		if err == nil {
			return checkAdmin(ctx, principal{id: claims.subject, method: "jwt", role: claims.role})
		}
		// A token shaped like a JWT is an invalid JWT, not an API key (as 0.3.x).
		if strings.Count(token, ".") == 2 {
			s.log.Warn("control plane: invalid JWT", zap.Error(err))
			return none, unauthorized(ctx, "Invalid JWT: "+err.Error())
		}
	}
	if k := s.findControlPlaneKey(token); k != nil {
		return checkAdmin(ctx, principal{id: k.ID, method: "api_key", role: k.Role})
	}
	return none, unauthorized(ctx, "Invalid authentication token")
}

// findControlPlaneKey compares SHA-256 digests in constant time and looks
// at every key, so timing tells nothing about which (if any) matched.
func (s *Server) findControlPlaneKey(token string) *ControlPlaneKey {
	sum := sha256.Sum256([]byte(token))
	var found *ControlPlaneKey
	for i := range s.cpKeyHashes {
		if subtle.ConstantTimeCompare(sum[:], s.cpKeyHashes[i][:]) == 1 {
			found = &s.cfg.ControlPlane.APIKeys[i]
		}
	}
	return found
}

func checkAdmin(ctx *fasthttp.RequestCtx, p principal) (principal, bool) {
	if p.role == RoleAdmin {
		return p, true
	}
	ctx.SetStatusCode(fasthttp.StatusForbidden)
	ctx.SetContentType("text/plain; charset=utf-8")
	ctx.SetBodyString("Admin role required for control plane access")
	return p, false
}

func unauthorized(ctx *fasthttp.RequestCtx, msg string) bool {
	ctx.SetStatusCode(fasthttp.StatusUnauthorized)
	ctx.Response.Header.Set("WWW-Authenticate", `Bearer realm="control-plane"`)
	ctx.SetContentType("text/plain; charset=utf-8")
	ctx.SetBodyString(msg)
	return false
}

// maxAuditField bounds what a client can put in one audit line.
const maxAuditField = 1024

func auditField(s string) string {
	if len(s) > maxAuditField {
		return s[:maxAuditField] + "...[TRUNCATED]"
	}
	return s // zap escapes control characters: no log injection
}

func (s *Server) audit(ctx *fasthttp.RequestCtx, p principal, allowed bool) {
	outcome := "success"
	if !allowed {
		outcome = "denied"
	}
	path, _ := url.PathUnescape(string(ctx.Request.URI().PathOriginal()))
	s.log.Info("control_plane_audit",
		zap.String("principal", auditField(p.id)),
		zap.String("auth_method", p.method),
		zap.String("role", string(p.role)),
		zap.String("method", string(ctx.Method())),
		zap.String("path", auditField(path)),
		zap.String("outcome", outcome),
		zap.Int("status", ctx.Response.StatusCode()),
		zap.String("request_id", auditField(string(ctx.Response.Header.Peek("x-request-id")))))
}
