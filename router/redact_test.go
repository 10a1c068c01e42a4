package router

import (
	"net"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/pdrouter/pdrouter/mock/mockworker"
	"github.com/pdrouter/pdrouter/testkit/testenv"
)

// jsonLogger is --json-log at debug level, into buf.
func jsonLogger(buf *testenv.SyncBuffer) *zap.Logger {
	return zap.New(zapcore.NewCore(zapcore.NewJSONEncoder(zap.NewProductionEncoderConfig()), buf, zapcore.DebugLevel))
}

const secret = "sk-live-7f3a9c"

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
