package router

import (
	"errors"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/pdrouter/pdrouter/internal/mockworker"
	"github.com/pdrouter/pdrouter/internal/testenv"
)

// jsonLogger is --json-log at debug level, into buf.
func jsonLogger(buf *testenv.SyncBuffer) *zap.Logger {
	return zap.New(zapcore.NewCore(zapcore.NewJSONEncoder(zap.NewProductionEncoderConfig()), buf, zapcore.DebugLevel))
}

const secret = "sk-live-7f3a9c"

func TestRedactSecrets(t *testing.T) {
	for in, want := range map[string]string{
		"Authorization: Bearer " + secret + "\r\nHost: x": "Authorization: " + redacted + "\r\nHost: x",
		"cookie=session=" + secret + "; path=/":           "cookie=" + redacted + "; path=/",
		"Set-Cookie: id=" + secret:                        "Set-Cookie: " + redacted,
		"X-Api-Key: " + secret:                            "X-Api-Key: " + redacted,
		"proxy-authorization: Basic dXNlcjpwYXNz":         "proxy-authorization: " + redacted,
		"token was Bearer\t" + secret + " in the query":   "token was Bearer " + redacted + " in the query",
		"basic checks passed":                             "basic checks passed",
		"worker http://10.0.0.1:30000 not healthy":        "worker http://10.0.0.1:30000 not healthy",
	} {
		if got := redactSecrets(in); got != want {
			t.Errorf("redactSecrets(%q) = %q, want %q", in, got, want)
		}
	}
}

// Every kind of text a log line carries is redacted, in the message, in
// fields, in errors and in fields added with With; other text is kept.
func TestRedactLoggerCoversEveryField(t *testing.T) {
	var buf testenv.SyncBuffer
	log := redactLogger(jsonLogger(&buf)).With(zap.String("ctx", "Cookie: a="+secret))
	log.Info("head was Authorization: Bearer "+secret,
		zap.String("s", "x-api-key="+secret),
		zap.ByteString("b", []byte("Authorization: Basic "+secret+"ABCD")),
		zap.Error(fmt.Errorf("parse: %w", errors.New("Set-Cookie: id="+secret))),
		zap.Stringer("st", stringer("bearer "+secret)),
		zap.String("worker", "http://w:1"))
	out := buf.String()
	if strings.Contains(out, secret) {
		t.Fatalf("secret in log: %s", out)
	}
	for _, keep := range []string{`"worker":"http://w:1"`, `"s":"x-api-key=` + redacted, `head was Authorization: ` + redacted} {
		if !strings.Contains(out, keep) {
			t.Errorf("log lost %s: %s", keep, out)
		}
	}
}

type stringer string

func (s stringer) String() string { return string(s) }

// End to end, --json-log at debug: malformed heads, an oversized head and a
// proxied request, all carrying credentials, leave none in the log.
func TestRouterLogsNoCredentials(t *testing.T) {
	defer leakCheck(t)
	w := startMock(t, mockworker.Config{})
	cfg := DefaultConfig()
	cfg.WorkerURLs = []string{w.URL()}
	cfg.MaxHeaderSize = 4 << 10
	cfg.Policy = "round_robin"
	cfg.Manager.Health.Disabled = true
	var buf testenv.SyncBuffer
	srv, err := New(cfg, jsonLogger(&buf), prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	base := serveOnLoopback(t, srv)
	defer shutdown(t, srv)
	waitFor(t, srv.manager.Ready)
	addr := strings.TrimPrefix(base, "http://")

	for _, raw := range []string{
		"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + secret + "\r\nBad Header Line\r\n\r\n",
		"GET /health HTTP/1.1\r\nHost: x\r\nCookie: s=" + secret + "\r\nX-Pad: " + strings.Repeat("p", 8<<10) + "\r\n\r\n",
		"POST /generate HTTP/1.1\r\nHost: x\r\nX-Api-Key: " + secret + "\r\nContent-Length: 4\r\n\r\n{\"te",
		"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + secret + "\r\nContent-Type: application/json\r\nContent-Length: 12\r\n\r\n{\"text\":\"a\"}",
	} {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		_ = c.SetDeadline(time.Now().Add(5 * time.Second))
		_, _ = c.Write([]byte(raw))
		var reply [1 << 10]byte
		_, _ = c.Read(reply[:])
		c.Close()
	}
	waitFor(t, func() bool { return strings.Contains(buf.String(), "http server") }) // fasthttp's own lines came through
	if out := buf.String(); strings.Contains(out, secret) {
		t.Fatalf("credential in the router's log:\n%s", out)
	}
}
