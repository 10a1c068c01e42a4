package mockworker

import (
	"crypto/tls"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/pdrouter/pdrouter/testkit/testcerts"
)

func TestTLSRequiresClientCertificateWhenAsked(t *testing.T) {
	ca := testcerts.NewCA(t, "mock")
	srv := ca.Server(t, "worker")
	s, err := Start(Config{TLS: &TLS{CertFile: srv.CertFile, KeyFile: srv.KeyFile, ClientCAFile: ca.CertFile}})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if !strings.HasPrefix(s.URL(), "https://127.0.0.1:") {
		t.Fatalf("URL %s", s.URL())
	}
	get := func(cfg *tls.Config) (int, error) {
		tr := &http.Transport{TLSClientConfig: cfg}
		defer tr.CloseIdleConnections()
		resp, err := (&http.Client{Transport: tr}).Get(s.URL() + "/health")
		if err != nil {
			return 0, err
		}
		defer resp.Body.Close()
		_, _ = io.Copy(io.Discard, resp.Body)
		return resp.StatusCode, nil
	}
	client := ca.Client(t, "router")
	if code, err := get(&tls.Config{RootCAs: ca.Pool(), Certificates: []tls.Certificate{client.TLS}}); err != nil || code != 200 {
		t.Fatalf("with client certificate: %d %v", code, err)
	}
	if _, err := get(&tls.Config{RootCAs: ca.Pool()}); err == nil {
		t.Error("no client certificate: accepted")
	}
	other := testcerts.NewCA(t, "other").Client(t, "router")
	if _, err := get(&tls.Config{RootCAs: ca.Pool(), Certificates: []tls.Certificate{other.TLS}}); err == nil {
		t.Error("client certificate of another CA: accepted")
	}
}

func TestTLSFlags(t *testing.T) {
	ca := testcerts.NewCA(t, "mock")
	p := ca.Server(t, "w")
	c, err := ParseFlags("mock", []string{"--port", "0", "--tls-cert", p.CertFile, "--tls-key", p.KeyFile, "--tls-client-ca", ca.CertFile}, io.Discard)
	if err != nil || c.TLS == nil || c.TLS.ClientCAFile != ca.CertFile {
		t.Fatalf("%+v %v", c.TLS, err)
	}
	if _, err := ParseFlags("mock", []string{"--port", "0", "--tls-client-ca", ca.CertFile}, io.Discard); err == nil {
		t.Error("--tls-client-ca without a certificate accepted")
	}
	if _, err := Start(Config{TLS: &TLS{CertFile: p.CertFile, KeyFile: ca.CertFile}}); err == nil {
		t.Error("a CA certificate as the key accepted")
	}
}
