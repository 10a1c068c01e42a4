package cpauth

import (
	"context"
	"errors"
	"strings"
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
)

func TestJWTRoleFromClaimWithoutMapping(t *testing.T) {
	v := &jwtValidator{cfg: JWTConfig{RoleClaim: "roles"}}
	for _, c := range []struct {
		claims map[string]any
		want   Role
	}{
		{map[string]any{"roles": []any{"reader", "ADMIN"}}, RoleAdmin},
		{map[string]any{"groups": "admin"}, RoleAdmin}, // the configured claim is absent: alternates
		{map[string]any{"roles": "reader", "groups": "admin"}, RoleUser},
		{map[string]any{}, RoleUser},
	} {
		if got := v.role(c.claims); got != c.want {
			t.Errorf("%v: %s, want %s", c.claims, got, c.want)
		}
	}
}

func TestParseKeysAndRoleMapping(t *testing.T) {
	if k, err := ParseKey("id:My Name:Admin:se:cr:et"); err != nil || k.Key != "se:cr:et" || k.Role != RoleAdmin || k.Name != "My Name" {
		t.Errorf("%+v %v", k, err)
	}
	for _, bad := range []string{"id:name:admin", "id:name:root:key"} {
		if _, err := ParseKey(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
	if _, err := ParseKey("id:name:secret"); err == nil || strings.Contains(err.Error(), "secret") {
		t.Errorf("error shows the key: %v", err)
	}
	if _, err := ParseRoleMapping([]string{"A=admin", "B"}); err == nil {
		t.Error("mapping without = accepted")
	}
}

func TestCheckAPIKeys(t *testing.T) {
	cfg := Config{APIKeys: []Key{{ID: "ops", Role: RoleAdmin, Key: "adm1n"}, {ID: "ro", Role: RoleUser, Key: "r3ad"}}}
	a, err := New(context.Background(), cfg, "data-key", zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		header   string
		id       string
		status   int // 0: allowed
		contains string
	}{
		{"", "unauthenticated", 401, "Missing or invalid Authorization header"},
		{"Basic adm1n", "unauthenticated", 401, "Missing"},
		{"Bearer nope", "unauthenticated", 401, "Invalid authentication token"},
		{"Bearer data-key", "unauthenticated", 401, "Invalid authentication token"}, // --api-key does not open the control plane
		{"Bearer a.b.c", "unauthenticated", 401, "Invalid authentication token"},    // no JWT configured: looked up as a key
		{"Bearer r3ad", "ro", 403, "Admin role required"},
		{"Bearer adm1n", "ops", 0, ""},
	} {
		p, err := a.Check(context.Background(), c.header)
		var d *Denied
		switch {
		case p.ID != c.id:
			t.Errorf("%q: principal %q, want %q", c.header, p.ID, c.id)
		case c.status == 0 && err != nil:
			t.Errorf("%q: refused: %v", c.header, err)
		case c.status != 0 && (!errors.As(err, &d) || d.Status != c.status || d.RouterKey || !strings.Contains(d.Message, c.contains)):
			t.Errorf("%q: %#v, want %d %q", c.header, err, c.status, c.contains)
		}
	}
}

// Without control-plane auth the router's --api-key guards the admin
// routes, and without one they are open.
func TestCheckFallsBackToRouterKey(t *testing.T) {
	open, _ := New(context.Background(), Config{}, "", zap.NewNop())
	if p, err := open.Check(context.Background(), ""); err != nil || p.Role != RoleAdmin || p.ID != "anonymous" {
		t.Errorf("no keys at all: %+v %v", p, err)
	}
	keyed, _ := New(context.Background(), Config{}, "data-key", zap.NewNop())
	for header, ok := range map[string]bool{"Bearer data-key": true, "bearer data-key": true, "Bearer other": false, "data-key": false, "": false} {
		p, err := keyed.Check(context.Background(), header)
		var d *Denied
		if ok && (err != nil || p.Method != "router_api_key") {
			t.Errorf("%q: %+v %v", header, p, err)
		}
		if !ok && (!errors.As(err, &d) || d.Status != 401 || !d.RouterKey) {
			t.Errorf("%q: %#v, want a 401 under the router key", header, err)
		}
	}
}

func TestAuditLine(t *testing.T) {
	core, logs := observer.New(zap.InfoLevel)
	quiet, _ := New(context.Background(), Config{APIKeys: []Key{{ID: "k", Role: RoleAdmin, Key: "x"}}}, "", zap.New(core))
	quiet.Audit(Principal{ID: "k"}, Call{Method: "GET", Path: "/workers", Allowed: true})
	if logs.Len() != 0 {
		t.Fatalf("audit off, yet logged: %v", logs.All())
	}
	a, _ := New(context.Background(), Config{APIKeys: []Key{{ID: "k", Role: RoleAdmin, Key: "x"}}, Audit: true}, "", zap.New(core))
	long := "/workers/" + strings.Repeat("a", 2*maxAuditField)
	a.Audit(Principal{ID: "k", Method: "api_key", Role: RoleAdmin}, Call{Method: "DELETE", Path: long, Status: 403, RequestID: "r1"})
	e := logs.FilterMessage("control_plane_audit").All()
	if len(e) != 1 {
		t.Fatalf("audit lines: %v", logs.All())
	}
	m := e[0].ContextMap()
	if m["principal"] != "k" || m["outcome"] != "denied" || m["status"] != int64(403) || m["request_id"] != "r1" ||
		!strings.HasSuffix(m["path"].(string), "...[TRUNCATED]") || len(m["path"].(string)) > maxAuditField+20 {
		t.Errorf("audit line: %v", m)
	}
}
