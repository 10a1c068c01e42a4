package redact

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/pdrouter/pdrouter/testkit/testenv"
)

func jsonLogger(buf *testenv.SyncBuffer) *zap.Logger {
	return zap.New(zapcore.NewCore(zapcore.NewJSONEncoder(zap.NewProductionEncoderConfig()), buf, zapcore.DebugLevel))
}

const secret = "sk-live-7f3a9c"

func TestRedactSecrets(t *testing.T) {
	for in, want := range map[string]string{
		"Authorization: Bearer " + secret + "\r\nHost: x": "Authorization: " + mark + "\r\nHost: x",
		"cookie=session=" + secret + "; path=/":           "cookie=" + mark + "; path=/",
		"Set-Cookie: id=" + secret:                        "Set-Cookie: " + mark,
		"X-Api-Key: " + secret:                            "X-Api-Key: " + mark,
		"proxy-authorization: Basic dXNlcjpwYXNz":         "proxy-authorization: " + mark,
		"token was Bearer\t" + secret + " in the query":   "token was Bearer " + mark + " in the query",
		"basic checks passed":                             "basic checks passed",
		"worker http://10.0.0.1:30000 not healthy":        "worker http://10.0.0.1:30000 not healthy",
	} {
		if got := Secrets(in); got != want {
			t.Errorf("Secrets(%q) = %q, want %q", in, got, want)
		}
	}
}

// Every kind of text a log line carries is redacted, in the message, in
// fields, in errors and in fields added with With; other text is kept.
func TestRedactLoggerCoversEveryField(t *testing.T) {
	var buf testenv.SyncBuffer
	log := Logger(jsonLogger(&buf)).With(zap.String("ctx", "Cookie: a="+secret))
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
	for _, keep := range []string{`"worker":"http://w:1"`, `"s":"x-api-key=` + mark, `head was Authorization: ` + mark} {
		if !strings.Contains(out, keep) {
			t.Errorf("log lost %s: %s", keep, out)
		}
	}
}

type stringer string

func (s stringer) String() string { return string(s) }
