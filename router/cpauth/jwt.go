package cpauth

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/MicahParks/keyfunc/v3"
	"github.com/golang-jwt/jwt/v5"
	"go.uber.org/zap"
	"golang.org/x/time/rate"
)

// JWTConfig is --jwt-issuer, --jwt-audience, --jwt-jwks-uri and
// --jwt-role-mapping (0.3.x's JwtConfig). Tokens are verified with keys
// from the JWKS URI, discovered from the issuer's
// /.well-known/openid-configuration when it is not given.
type JWTConfig struct {
	Issuer, Audience string
	JWKSURI          string          // "" = OIDC discovery from Issuer
	RoleClaim        string          // "" = "roles"
	RoleMapping      map[string]Role // IdP role or group -> gateway role; empty = the claim names the role
	Leeway           time.Duration   // clock skew allowed on exp and nbf; 0 = 30 s
}

func (c *JWTConfig) validate() error {
	if c.Issuer == "" || c.Audience == "" {
		return errors.New("JWT authentication needs both --jwt-issuer and --jwt-audience")
	}
	if err := jwksURLAllowed(c.JWKSURI); c.JWKSURI != "" && err != nil {
		return fmt.Errorf("--jwt-jwks-uri: %v", err)
	}
	if err := jwksURLAllowed(c.Issuer); c.JWKSURI == "" && err != nil {
		return fmt.Errorf("--jwt-issuer (used for OIDC discovery without --jwt-jwks-uri): %v", err)
	}
	if c.Leeway < 0 {
		return errors.New("JWT leeway must be >= 0")
	}
	return nil
}

// jwksURLAllowed is 0.3.x's rule: keys come over https, or plain http
// from the local host only (tests, sidecars).
func jwksURLAllowed(raw string) error {
	u, err := url.Parse(raw)
	if err != nil || u.Host == "" {
		return fmt.Errorf("invalid URL %q", raw)
	}
	switch u.Scheme {
	case "https":
		return nil
	case "http":
		if h := u.Hostname(); h == "localhost" || net.ParseIP(h).IsLoopback() {
			return nil
		}
		return fmt.Errorf("%q: only https URLs are allowed (plain http only on localhost)", raw)
	}
	return fmt.Errorf("%q: scheme must be https", raw)
}

// jwtValidator checks bearer JWTs. It uses github.com/golang-jwt/jwt/v5
// (signature, exp/nbf/iss/aud) with github.com/MicahParks/keyfunc/v3 (JWKS
// fetch, hourly refresh, refetch on an unknown kid, rate limited).
type jwtValidator struct {
	cfg    JWTConfig
	keys   keyfunc.Keyfunc
	parser *jwt.Parser
}

// jwtAlgorithms are those 0.3.x accepts: RSA and ECDSA, never HMAC or none.
var jwtAlgorithms = []string{"RS256", "RS384", "RS512", "ES256", "ES384"}

// newJWTValidator discovers the JWKS URI if needed (a failure is a
// start-up error) and starts the key refresher, which ends with ctx.
func newJWTValidator(ctx context.Context, cfg JWTConfig, log *zap.Logger) (*jwtValidator, error) {
	if cfg.RoleClaim == "" {
		cfg.RoleClaim = "roles"
	}
	if cfg.Leeway == 0 {
		cfg.Leeway = 30 * time.Second
	}
	client := &http.Client{Timeout: 10 * time.Second}
	if cfg.JWKSURI == "" {
		uri, err := discoverJWKS(ctx, client, cfg.Issuer)
		if err != nil {
			return nil, err
		}
		cfg.JWKSURI = uri
	}
	keys, err := keyfunc.NewDefaultOverrideCtx(ctx, []string{cfg.JWKSURI}, keyfunc.Override{
		Client:      client,
		HTTPTimeout: 10 * time.Second,
		// An unknown kid (a rotated key) refetches the set at most once a
		// second; a request waits for that at most 2 s.
		RefreshUnknownKID: rate.NewLimiter(rate.Every(time.Second), 1),
		RateLimitWaitMax:  2 * time.Second,
		RefreshErrorHandlerFunc: func(u string) func(context.Context, error) {
			return func(_ context.Context, err error) {
				log.Warn("JWKS refresh failed", zap.String("uri", u), zap.Error(err))
			}
		},
	})
	if err != nil {
		return nil, fmt.Errorf("JWKS %s: %w", cfg.JWKSURI, err)
	}
	return &jwtValidator{cfg: cfg, keys: keys, parser: jwt.NewParser(
		jwt.WithValidMethods(jwtAlgorithms),
		jwt.WithIssuer(cfg.Issuer),
		jwt.WithAudience(cfg.Audience),
		jwt.WithLeeway(cfg.Leeway),
		jwt.WithExpirationRequired(),
	)}, nil
}

func discoverJWKS(ctx context.Context, client *http.Client, issuer string) (string, error) {
	u := strings.TrimSuffix(issuer, "/") + "/.well-known/openid-configuration"
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return "", err
	}
	resp, err := client.Do(req)
	if err != nil {
		return "", fmt.Errorf("OIDC discovery: %w", err)
	}
	defer resp.Body.Close()
	var doc struct {
		JWKSURI string `json:"jwks_uri"`
	}
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("OIDC discovery: %s answered %s", u, resp.Status)
	}
	if err := json.NewDecoder(http.MaxBytesReader(nil, resp.Body, 1<<20)).Decode(&doc); err != nil || doc.JWKSURI == "" {
		return "", fmt.Errorf("OIDC discovery: %s has no jwks_uri (%v)", u, err)
	}
	if err := jwksURLAllowed(doc.JWKSURI); err != nil {
		return "", fmt.Errorf("OIDC discovery: jwks_uri %w", err)
	}
	return doc.JWKSURI, nil
}

type jwtClaims struct {
	jwt.RegisteredClaims
	Email             string `json:"email"`
	PreferredUsername string `json:"preferred_username"`
	extra             map[string]any
}

func (c *jwtClaims) UnmarshalJSON(b []byte) error {
	type plain jwtClaims
	if err := json.Unmarshal(b, (*plain)(c)); err != nil {
		return err
	}
	return json.Unmarshal(b, &c.extra)
}

type validatedToken struct {
	subject string
	role    Role
}

var errNoKID = errors.New("token header missing 'kid'")

func (v *jwtValidator) validate(ctx context.Context, token string) (validatedToken, error) {
	var claims jwtClaims
	_, err := v.parser.ParseWithClaims(token, &claims, func(t *jwt.Token) (any, error) {
		if _, ok := t.Header["kid"].(string); !ok {
			return nil, errNoKID
		}
		return v.keys.KeyfuncCtx(ctx)(t)
	})
	if err != nil {
		return validatedToken{}, err
	}
	sub := claims.Subject
	for _, alt := range []string{claims.Email, claims.PreferredUsername, "unknown"} {
		if sub == "" {
			sub = alt
		}
	}
	return validatedToken{subject: sub, role: v.role(claims.extra)}, nil
}

// role follows 0.3.x: the configured claim, else any of role, roles,
// groups, group; mapped through RoleMapping, or read as admin/user when
// there is none; user when nothing matches.
func (v *jwtValidator) role(claims map[string]any) Role {
	names := claimStrings(claims[v.cfg.RoleClaim])
	if _, ok := claims[v.cfg.RoleClaim]; !ok {
		for _, alt := range []string{"role", "roles", "groups", "group"} {
			names = append(names, claimStrings(claims[alt])...)
		}
	}
	for _, n := range names {
		if len(v.cfg.RoleMapping) > 0 {
			if r, ok := v.cfg.RoleMapping[n]; ok {
				return r
			}
		} else if r, err := ParseRole(n); err == nil {
			return r
		}
	}
	return RoleUser
}

func claimStrings(v any) []string {
	switch v := v.(type) {
	case string:
		return []string{v}
	case []any:
		var out []string
		for _, e := range v {
			if s, ok := e.(string); ok {
				out = append(out, s)
			}
		}
		return out
	}
	return nil
}
