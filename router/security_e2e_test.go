package router_test

import (
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"

	"github.com/pdrouter/pdrouter/testkit/testcerts"
	"github.com/pdrouter/pdrouter/testkit/testenv"
)

var certSeq atomic.Int64

// startTLSWorker runs an https mockworker with a certificate of ca;
// clientCA, when set, makes it require client certificates it signed.
func startTLSWorker(t *testing.T, ca *testcerts.CA, role string, clientCA *testcerts.CA) (worker, string) {
	t.Helper()
	pair := ca.Server(t, fmt.Sprintf("%s-%d", role, certSeq.Add(1)))
	args := []string{"--tls-cert", pair.CertFile, "--tls-key", pair.KeyFile}
	if clientCA != nil {
		args = append(args, "--tls-client-ca", clientCA.CertFile)
	}
	w := startWorker(t, role, args...)
	return w, "https://" + w.Addr
}

// trusting is an HTTP client that trusts ca (and presents cert, if any).
func trusting(ca *testcerts.CA, cert ...tls.Certificate) *http.Client {
	return &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{
		TLSClientConfig: &tls.Config{RootCAs: ca.Pool(), Certificates: cert}}}
}

// secureRouter runs pdrouter with args and waits for /health over base
// (http:// or https://) with c.
type secureRouter struct {
	*testenv.Proc
	base, metrics string
}

func startSecureRouter(t *testing.T, scheme string, c *http.Client, args ...string) secureRouter {
	t.Helper()
	port, prom := testenv.FreePort(t), testenv.FreePort(t)
	all := append([]string{"--host", "127.0.0.1", "--port", strconv.Itoa(port), "--prometheus-host", "127.0.0.1",
		"--prometheus-port", strconv.Itoa(prom), "--log-level", "info"}, args...)
	r := secureRouter{Proc: testenv.Start(t, testenv.Binary(t, "pdrouter"), all...),
		base: scheme + "://127.0.0.1:" + strconv.Itoa(port), metrics: "http://127.0.0.1:" + strconv.Itoa(prom) + "/metrics"}
	waitCode(t, c, "GET", r.base+"/health", "", 200, 30*time.Second)
	return r
}

// waitCode polls until method url answers want.
func waitCode(t *testing.T, c *http.Client, method, url, auth string, want int, d time.Duration) {
	t.Helper()
	deadline := time.Now().Add(d)
	last := "no answer"
	for time.Now().Before(deadline) {
		code, body, err := call(c, method, url, auth, "")
		if err == nil && code == want {
			return
		}
		last = fmt.Sprintf("%d %s %v", code, body, err)
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatalf("%s %s: want %d within %v, last %s", method, url, want, d, last)
}

func call(c *http.Client, method, url, auth, body string) (int, string, error) {
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		return 0, "", err
	}
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	if auth != "" {
		req.Header.Set("Authorization", "Bearer "+auth)
	}
	resp, err := c.Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), nil
}

// install copies p over certPath/keyPath by rename, as a secret update does.
func install(t *testing.T, p *testcerts.Pair, certPath, keyPath string) {
	t.Helper()
	for src, dst := range map[string][]byte{certPath: p.CertPEM, keyPath: p.KeyPEM} {
		if err := os.WriteFile(src+".tmp", dst, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(src+".tmp", src); err != nil {
			t.Fatal(err)
		}
	}
}

// servedName is the common name of the certificate the router presents.
func servedName(t *testing.T, ca *testcerts.CA, addr string) (string, string) {
	t.Helper()
	c, err := tls.Dial("tcp", addr, &tls.Config{RootCAs: ca.Pool(), ServerName: "127.0.0.1", NextProtos: []string{"h2", "http/1.1"}})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	st := c.ConnectionState()
	return st.PeerCertificates[0].Subject.CommonName, st.NegotiatedProtocol
}

func TestHTTPSFrontEndWithOpenAIClientAndCertificateRotation(t *testing.T) {
	ca := testcerts.NewCA(t, "front")
	dir := t.TempDir()
	certPath, keyPath := filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
	install(t, ca.Server(t, "front-1"), certPath, keyPath)
	p, d := startWorker(t, "prefill"), startWorker(t, "decode")
	c := trusting(ca)
	r := startSecureRouter(t, "https", c, "--pd-disaggregation", "--policy", "round_robin",
		"--prefill", p.URL(), "8998", "--decode", d.URL(), "--tls-cert-path", certPath, "--tls-key-path", keyPath)
	waitCode(t, c, "GET", r.base+"/readiness", "", 200, 30*time.Second)
	addr := strings.TrimPrefix(r.base, "https://")

	ai := openai.NewClient(option.WithBaseURL(r.base+"/v1/"), option.WithAPIKey("unused"),
		option.WithHTTPClient(c), option.WithMaxRetries(0))
	chat := func() {
		t.Helper()
		resp, err := ai.Chat.Completions.New(context.Background(), openai.ChatCompletionNewParams{
			Model: "mock", Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("hello over TLS")}})
		if err != nil {
			t.Fatal(err)
		}
		if len(resp.Choices) != 1 || resp.Choices[0].Message.Content == "" {
			t.Fatalf("empty completion %+v", resp)
		}
	}
	chat()
	if name, proto := servedName(t, ca, addr); name != "front-1" || proto != "http/1.1" {
		t.Fatalf("served %q with ALPN %q, want front-1 and http/1.1", name, proto)
	}
	// Plain HTTP on the TLS port gets no answer; Prometheus stays plain.
	if code, _, err := call(client, "GET", "http://"+addr+"/health", "", ""); err == nil && code == 200 {
		t.Error("plain HTTP answered on the HTTPS port")
	}
	if code, _, err := call(client, "GET", r.metrics, "", ""); err != nil || code != 200 {
		t.Errorf("metrics over plain HTTP: %d %v", code, err)
	}

	install(t, ca.Server(t, "front-2"), certPath, keyPath)
	deadline := time.Now().Add(10 * time.Second)
	for name, _ := servedName(t, ca, addr); name != "front-2"; name, _ = servedName(t, ca, addr) {
		if time.Now().After(deadline) {
			t.Fatalf("still serving %q 10 s after rotation", name)
		}
		time.Sleep(100 * time.Millisecond)
	}
	c.CloseIdleConnections()
	chat()
	if !strings.Contains(r.Output(), "HTTPS certificate reloaded") {
		t.Error("rotation not logged")
	}
}

func TestWorkerMTLSOnEveryConnection(t *testing.T) {
	ca := testcerts.NewCA(t, "workers")
	_, pURL := startTLSWorker(t, ca, "prefill", ca)
	_, dURL := startTLSWorker(t, ca, "decode", ca)
	routerCert := ca.Client(t, "router")
	mtls := []string{"--ca-cert-paths", ca.CertFile, "--client-cert-path", routerCert.CertFile, "--client-key-path", routerCert.KeyFile}
	pdArgs := []string{"--pd-disaggregation", "--policy", "round_robin", "--prefill", pURL, "8998", "--decode", dURL,
		"--health-check-interval-secs", "1", "--worker-startup-timeout-secs", "3"}

	r := startSecureRouter(t, "http", client, append(pdArgs, mtls...)...)
	waitCode(t, client, "GET", r.base+"/readiness", "", 200, 30*time.Second) // health checks over mTLS
	for _, stream := range []bool{false, true} {
		code, body, err := call(client, "POST", r.base+"/generate", "", fmt.Sprintf(`{"text":"hi","stream":%v}`, stream))
		if err != nil || code != 200 || !strings.Contains(body, "meta_info") {
			t.Fatalf("generate stream=%v: %d %s %v", stream, code, body, err)
		}
	}
	_, recorded, err := call(trusting(ca, routerCert.TLS), "GET", pURL+"/_mock/requests", "", "")
	if n := strings.Count(recorded, `"path":"/generate"`); err != nil || n != 2 {
		t.Errorf("prefill worker saw %d requests (%v), want 2", n, err)
	}
	// Info fan-out and load polling.
	code, body, err := call(client, "GET", r.base+"/get_loads", "", "")
	if err != nil || code != 200 || strings.Contains(body, `"load":-1`) || !strings.Contains(body, `"successful":2`) {
		t.Errorf("get_loads: %d %s %v", code, body, err)
	}
	if code, body, _ := call(client, "GET", r.base+"/v1/models", "", ""); code != 200 || !strings.Contains(body, `"mock"`) {
		t.Errorf("models (discovered over mTLS): %d %s", code, body)
	}
	// Admin registration of another mTLS worker.
	_, d2URL := startTLSWorker(t, ca, "decode", ca)
	code, body, _ = call(client, "POST", r.base+"/workers", "", `{"url":"`+d2URL+`","worker_type":"decode"}`)
	if code != 202 {
		t.Fatalf("POST /workers: %d %s", code, body)
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		_, body, _ = call(client, "GET", r.base+"/workers", "", "")
		if strings.Count(body, `"is_healthy":true`) == 3 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the added mTLS worker never became healthy: %s", body)
		}
		time.Sleep(50 * time.Millisecond)
	}

	// Without the client certificate, or trusting another CA, no worker is
	// ever healthy: the router answers 503 at once and says why in its log.
	other := testcerts.NewCA(t, "other")
	for name, args := range map[string][]string{
		"no client certificate": {"--ca-cert-paths", ca.CertFile},
		"wrong CA":              {"--ca-cert-paths", other.CertFile, "--client-cert-path", routerCert.CertFile, "--client-key-path", routerCert.KeyFile},
	} {
		t.Run(name, func(t *testing.T) {
			bad := startSecureRouter(t, "http", client, append(pdArgs, args...)...)
			time.Sleep(500 * time.Millisecond) // several startup probes
			if code, _, _ := call(client, "GET", bad.base+"/readiness", "", ""); code != 503 {
				t.Errorf("readiness %d, want 503", code)
			}
			start := time.Now()
			code, body, err := call(client, "POST", bad.base+"/generate", "", `{"text":"hi"}`)
			if err != nil || code < 500 || time.Since(start) > 5*time.Second {
				t.Errorf("generate: %d %s %v after %v, want a quick 5xx", code, body, err, time.Since(start))
			}
			deadline := time.Now().Add(10 * time.Second)
			for !strings.Contains(bad.Output(), "worker TLS failed") {
				if time.Now().After(deadline) {
					t.Fatalf("no TLS error in the log:\n%s", bad.Output())
				}
				time.Sleep(50 * time.Millisecond)
			}
		})
	}
}

func TestControlPlaneAPIKeysAndAudit(t *testing.T) {
	w := startWorker(t, "regular")
	r := startSecureRouter(t, "http", client, "--worker-urls", w.URL(), "--policy", "round_robin", "--api-key", "data-key",
		"--control-plane-api-keys", "ops:Ops Team:admin:adm1n:with:colons", "ro:Read Only:user:r3ad",
		"--control-plane-audit-enabled")
	waitCode(t, client, "GET", r.base+"/readiness", "", 200, 30*time.Second)
	for _, c := range []struct {
		auth string
		want int
		body string
	}{
		{"", 401, "Missing or invalid Authorization header"},
		{"nope", 401, "Invalid authentication token"},
		{"data-key", 401, "Invalid authentication token"}, // --api-key no longer opens the admin routes
		{"r3ad", 403, "Admin role required"},
		{"adm1n:with:colons", 200, `"total":1`},
	} {
		code, body, err := call(client, "GET", r.base+"/workers", c.auth, "")
		if err != nil || code != c.want || !strings.Contains(body, c.body) {
			t.Errorf("GET /workers with %q: %d %s %v; want %d %q", c.auth, code, body, err, c.want, c.body)
		}
	}
	if code, _, _ := call(client, "POST", r.base+"/flush_cache", "r3ad", ""); code != 403 {
		t.Errorf("flush_cache as user: %d", code)
	}
	// The data plane keeps --api-key.
	if code, _, _ := call(client, "POST", r.base+"/generate", "data-key", `{"text":"x"}`); code != 200 {
		t.Errorf("generate with --api-key: %d", code)
	}
	if code, _, _ := call(client, "POST", r.base+"/generate", "adm1n:with:colons", `{"text":"x"}`); code != 401 {
		t.Errorf("generate with a control-plane key: %d, want 401", code)
	}
	deadline := time.Now().Add(5 * time.Second)
	for !(strings.Contains(r.Output(), `"principal": "ops"`) && strings.Contains(r.Output(), `"outcome": "denied"`)) {
		if time.Now().After(deadline) {
			t.Fatalf("audit lines missing:\n%s", r.Output())
		}
		time.Sleep(20 * time.Millisecond)
	}
	if strings.Contains(r.Output(), "adm1n") || strings.Contains(r.Output(), "r3ad") {
		t.Error("a key's secret reached the log")
	}
}

func TestUnimplementedFlagsFailStartUp(t *testing.T) {
	for _, args := range [][]string{{"--enable-igw"}, {"--backend", "openai"}} {
		p := testenv.Start(t, testenv.Binary(t, "pdrouter"), append([]string{"--port", strconv.Itoa(testenv.FreePort(t))}, args...)...)
		if code := p.Wait(30 * time.Second); code != 1 {
			t.Errorf("%v: exit %d, want 1", args, code)
		}
		if !strings.Contains(p.Output(), "not implemented by pdrouter, refusing to start") {
			t.Errorf("%v: output %q", args, p.Output())
		}
	}
}
