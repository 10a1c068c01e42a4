package router

import (
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"encoding/base64"
	"encoding/json"
	"errors"
	"io"
	"math/big"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/golang-jwt/jwt/v5"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/goleak"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/pdrouter/pdrouter/router/cpauth"
	"github.com/pdrouter/pdrouter/testkit/testenv"
)

// jwks is a local identity provider's key set; keys can be added while
// the router runs (rotation).
type jwks struct {
	mu      sync.Mutex
	keys    []map[string]string
	fetches int
}

func (j *jwks) ServeHTTP(w http.ResponseWriter, _ *http.Request) {
	j.mu.Lock()
	defer j.mu.Unlock()
	j.fetches++
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(map[string]any{"keys": j.keys})
}

func b64(b []byte) string { return base64.RawURLEncoding.EncodeToString(b) }

func (j *jwks) addRSA(t *testing.T, kid string) crypto.Signer {
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		t.Fatal(err)
	}
	j.mu.Lock()
	j.keys = append(j.keys, map[string]string{"kty": "RSA", "kid": kid, "alg": "RS256", "use": "sig",
		"n": b64(key.N.Bytes()), "e": b64(big.NewInt(int64(key.E)).Bytes())})
	j.mu.Unlock()
	return key
}

func (j *jwks) addEC(t *testing.T, kid string) crypto.Signer {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	pub, err := key.PublicKey.ECDH()
	if err != nil {
		t.Fatal(err)
	}
	point := pub.Bytes() // 0x04 || X || Y
	j.mu.Lock()
	j.keys = append(j.keys, map[string]string{"kty": "EC", "kid": kid, "alg": "ES256", "crv": "P-256",
		"x": b64(point[1:33]), "y": b64(point[33:])})
	j.mu.Unlock()
	return key
}

func sign(t *testing.T, key crypto.Signer, kid string, claims jwt.MapClaims) string {
	t.Helper()
	method := jwt.SigningMethod(jwt.SigningMethodRS256)
	if _, ok := key.(*ecdsa.PrivateKey); ok {
		method = jwt.SigningMethodES256
	}
	tok := jwt.NewWithClaims(method, claims)
	if kid != "" {
		tok.Header["kid"] = kid
	}
	s, err := tok.SignedString(key)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// authRouter serves a router with cfg's control-plane auth and no workers;
// the returned logs hold its audit lines.
func authRouter(t *testing.T, cp cpauth.Config) (string, *observer.ObservedLogs) {
	t.Helper()
	cfg := DefaultConfig()
	cfg.Policy = "round_robin"
	cfg.ControlPlane = cp
	core, logs := observer.New(zap.InfoLevel)
	srv, err := New(cfg, zap.New(core), prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	base := serveOnLoopback(t, srv)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(ctx)
	})
	return base, logs
}

func adminCall(t *testing.T, base, token string) (int, string) {
	t.Helper()
	req, _ := http.NewRequest("GET", base+"/workers", nil)
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.Header.Get("x-request-id") == "" { // refusals too
		t.Errorf("%d reply without x-request-id", resp.StatusCode)
	}
	return resp.StatusCode, string(b)
}

func TestJWTControlPlane(t *testing.T) {
	// Registered first, so it runs after the router's shutdown: the JWKS
	// refresher must have ended with it.
	before := goleak.IgnoreCurrent()
	t.Cleanup(func() {
		goleak.VerifyNone(t, before,
			goleak.IgnoreAnyFunction("github.com/valyala/fasthttp.updateServerDate.func1"),
			goleak.IgnoreAnyFunction("github.com/valyala/fasthttp.(*workerPool).Start.func2"))
	})
	idp := &jwks{}
	rsaKey := idp.addRSA(t, "rsa-1")
	ecKey := idp.addEC(t, "ec-1")
	keys := httptest.NewServer(idp)
	defer keys.Close()
	const iss, aud = "https://idp.example", "pdrouter"
	base, logs := authRouter(t, cpauth.Config{Audit: true, APIKeys: []cpauth.Key{{ID: "svc", Name: "svc", Role: cpauth.RoleAdmin, Key: "k"}},
		JWT: &cpauth.JWTConfig{Issuer: iss, Audience: aud, JWKSURI: keys.URL, RoleMapping: map[string]cpauth.Role{"Gateway.Admin": cpauth.RoleAdmin}}})
	now := time.Now()
	claims := func(mod func(jwt.MapClaims)) jwt.MapClaims {
		c := jwt.MapClaims{"iss": iss, "aud": aud, "sub": "alice", "exp": now.Add(time.Hour).Unix(), "roles": []string{"Gateway.Admin"}}
		if mod != nil {
			mod(c)
		}
		return c
	}
	for _, c := range []struct {
		name  string
		token string
		want  int
		body  string
	}{
		{"RS256 admin", sign(t, rsaKey, "rsa-1", claims(nil)), 200, `"total":0`},
		{"ES256 admin", sign(t, ecKey, "ec-1", claims(nil)), 200, `"total":0`},
		{"expired within leeway", sign(t, rsaKey, "rsa-1", claims(func(c jwt.MapClaims) { c["exp"] = now.Add(-10 * time.Second).Unix() })), 200, ""},
		{"expired", sign(t, rsaKey, "rsa-1", claims(func(c jwt.MapClaims) { c["exp"] = now.Add(-time.Minute).Unix() })), 401, "token is expired"},
		{"not yet valid", sign(t, rsaKey, "rsa-1", claims(func(c jwt.MapClaims) { c["nbf"] = now.Add(time.Minute).Unix() })), 401, "not valid yet"},
		{"no exp", sign(t, rsaKey, "rsa-1", claims(func(c jwt.MapClaims) { delete(c, "exp") })), 401, "exp"},
		{"wrong audience", sign(t, rsaKey, "rsa-1", claims(func(c jwt.MapClaims) { c["aud"] = "someone-else" })), 401, "audience"},
		{"wrong issuer", sign(t, rsaKey, "rsa-1", claims(func(c jwt.MapClaims) { c["iss"] = "https://evil" })), 401, "issuer"},
		{"unmapped role", sign(t, rsaKey, "rsa-1", claims(func(c jwt.MapClaims) { c["roles"] = "Gateway.User" })), 403, "Admin role required"},
		{"no kid", sign(t, rsaKey, "", claims(nil)), 401, "kid"},
		{"signed by an unknown key", sign(t, idpKeyNotPublished(t), "rsa-1", claims(nil)), 401, "signature"},
		{"API key still works", "k", 200, ""},
	} {
		code, body := adminCall(t, base, c.token)
		if code != c.want || !strings.Contains(body, c.body) {
			t.Errorf("%s: %d %q, want %d containing %q", c.name, code, body, c.want, c.body)
		}
	}

	// An unknown kid is refetched once (rate limited), then refused...
	code, body := adminCall(t, base, sign(t, rsaKey, "nobody", claims(nil)))
	if code != 401 {
		t.Errorf("unknown kid: %d %s", code, body)
	}
	// ...and a key the IdP publishes later (rotation) is found by that refetch.
	time.Sleep(1100 * time.Millisecond) // the refetch limiter's period
	rotated := idp.addEC(t, "ec-2")
	if code, body := adminCall(t, base, sign(t, rotated, "ec-2", claims(nil))); code != 200 {
		t.Errorf("rotated key: %d %s", code, body)
	}
	audits := logs.FilterMessage("control_plane_audit")
	var alice, denied bool
	for _, e := range audits.All() {
		m := e.ContextMap()
		alice = alice || m["principal"] == "alice" && m["auth_method"] == "jwt" && m["outcome"] == "success"
		denied = denied || m["outcome"] == "denied" && m["status"] == int64(401)
	}
	if !alice || !denied {
		t.Errorf("audit lines: %v", audits.All())
	}
}

func idpKeyNotPublished(t *testing.T) crypto.Signer {
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		t.Fatal(err)
	}
	return key
}

func TestControlPlaneConfigRules(t *testing.T) {
	valid := DefaultConfig()
	for name, mod := range map[string]func(*Config){
		"cert without key":        func(c *Config) { c.TLSCertPath = "c.pem" },
		"client key without cert": func(c *Config) { c.WorkerTLS.ClientKeyPath = "k.pem" },
		"JWT without audience":    func(c *Config) { c.ControlPlane.JWT = &cpauth.JWTConfig{Issuer: "https://i", JWKSURI: "https://i/k"} },
		"JWKS over plain http": func(c *Config) {
			c.ControlPlane.JWT = &cpauth.JWTConfig{Issuer: "i", Audience: "a", JWKSURI: "http://idp.example/keys"}
		},
		"issuer not a URL": func(c *Config) { c.ControlPlane.JWT = &cpauth.JWTConfig{Issuer: "i", Audience: "a"} },
		"duplicate key id": func(c *Config) {
			c.ControlPlane.APIKeys = []cpauth.Key{{ID: "a", Role: cpauth.RoleAdmin, Key: "1"}, {ID: "a", Role: cpauth.RoleUser, Key: "2"}}
		},
		"empty key": func(c *Config) { c.ControlPlane.APIKeys = []cpauth.Key{{ID: "a", Role: cpauth.RoleAdmin}} },
	} {
		c := valid
		mod(&c)
		var ce *ConfigError
		if err := c.Validate(); err == nil || !errors.As(err, &ce) {
			t.Errorf("%s: %v", name, err)
		}
	}
	ok := valid
	ok.ControlPlane.JWT = &cpauth.JWTConfig{Issuer: "i", Audience: "a", JWKSURI: "http://127.0.0.1:9/keys"}
	if err := ok.Validate(); err != nil {
		t.Errorf("JWKS on localhost over http: %v", err)
	}
}

// Without --jwt-jwks-uri the key set is found by OIDC discovery on the issuer.
func TestJWTDiscoversJWKSFromIssuer(t *testing.T) {
	idp := &jwks{}
	key := idp.addRSA(t, "k1")
	mux := http.NewServeMux()
	mux.Handle("/keys", idp)
	srv := httptest.NewServer(mux)
	defer srv.Close()
	mux.HandleFunc("/.well-known/openid-configuration", func(w http.ResponseWriter, _ *http.Request) {
		_ = json.NewEncoder(w).Encode(map[string]string{"issuer": srv.URL, "jwks_uri": srv.URL + "/keys"})
	})
	base, _ := authRouter(t, cpauth.Config{JWT: &cpauth.JWTConfig{Issuer: srv.URL, Audience: "gw"}})
	tok := sign(t, key, "k1", jwt.MapClaims{"iss": srv.URL, "aud": "gw", "sub": "bob", "role": "admin",
		"exp": time.Now().Add(time.Minute).Unix()})
	if code, body := adminCall(t, base, tok); code != 200 {
		t.Fatalf("discovered JWKS: %d %s", code, body)
	}

	// A discovery that fails stops start-up.
	cfg := DefaultConfig()
	cfg.ControlPlane.JWT = &cpauth.JWTConfig{Issuer: srv.URL + "/nothing-here", Audience: "gw"}
	if _, err := New(cfg, zap.NewNop(), prometheus.NewRegistry()); err == nil || !strings.Contains(err.Error(), "OIDC discovery") {
		t.Fatalf("failed discovery: %v", err)
	}
}

// The same checks through the pdrouter binary and its flags.
func TestJWTFlagsEndToEnd(t *testing.T) {
	idp := &jwks{}
	key := idp.addEC(t, "ec-e2e")
	keys := httptest.NewServer(idp)
	defer keys.Close()
	port := testenv.FreePort(t)
	base := "http://127.0.0.1:" + strconv.Itoa(port)
	p := testenv.Start(t, testenv.Binary(t, "pdrouter"), "--host", "127.0.0.1", "--port", strconv.Itoa(port),
		"--prometheus-port", "0", "--jwt-issuer", "https://idp.example", "--jwt-audience", "pdrouter",
		"--jwt-jwks-uri", keys.URL, "--jwt-role-mapping", "Gateway.Admin=admin", "--control-plane-audit-enabled")
	testenv.WaitStatus(t, base+"/health", 200, 30*time.Second)
	tok := func(mod func(jwt.MapClaims)) string {
		c := jwt.MapClaims{"iss": "https://idp.example", "aud": "pdrouter", "sub": "carol", "groups": []string{"Gateway.Admin"},
			"exp": time.Now().Add(time.Hour).Unix()}
		if mod != nil {
			mod(c)
		}
		return sign(t, key, "ec-e2e", c)
	}
	for name, c := range map[string]struct {
		token string
		want  int
	}{
		"good":           {tok(nil), 200},
		"expired":        {tok(func(c jwt.MapClaims) { c["exp"] = time.Now().Add(-time.Hour).Unix() }), 401},
		"wrong audience": {tok(func(c jwt.MapClaims) { c["aud"] = "other" }), 401},
		"user role":      {tok(func(c jwt.MapClaims) { c["groups"] = "Gateway.User" }), 403},
		"no token":       {"", 401},
	} {
		if code, body := adminCall(t, base, c.token); code != c.want {
			t.Errorf("%s: %d %s, want %d", name, code, body, c.want)
		}
	}
	deadline := time.Now().Add(5 * time.Second)
	for !strings.Contains(p.Output(), `"principal": "carol", "auth_method": "jwt"`) {
		if time.Now().After(deadline) {
			t.Fatalf("no audit line for carol:\n%s", p.Output())
		}
		time.Sleep(20 * time.Millisecond)
	}
}
