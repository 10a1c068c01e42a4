package tlsconfig

import (
	"crypto/tls"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/pdrouter/pdrouter/testkit/testcerts"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// handshake dials a TLS server using srv and returns the leaf it presented.
func handshake(t *testing.T, srv, cli *tls.Config) (string, error) {
	t.Helper()
	ln, err := tls.Listen("tcp", "127.0.0.1:0", srv)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	served := make(chan error, 1)
	go func() {
		c, err := ln.Accept()
		if err == nil {
			err = c.(*tls.Conn).Handshake()
			c.Close()
		}
		served <- err
	}()
	c, err := tls.Dial("tcp", ln.Addr().String(), cli)
	if err == nil {
		defer c.Close()
		name := c.ConnectionState().PeerCertificates[0].Subject.CommonName
		if proto := c.ConnectionState().NegotiatedProtocol; srv.NextProtos != nil && cli.NextProtos != nil && proto != "http/1.1" {
			t.Errorf("ALPN protocol %q, want http/1.1", proto)
		}
		<-served
		return name, nil
	}
	ln.Close()
	<-served
	return "", err
}

func TestServerReloadsRotatedCertificate(t *testing.T) {
	ca := testcerts.NewCA(t, "front")
	first := ca.Server(t, "first")
	second := ca.Server(t, "second")
	dir := t.TempDir()
	certPath, keyPath := filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
	install := func(p *testcerts.Pair) {
		// Kubernetes style: new files, then a rename over the old ones.
		for src, dst := range map[string]string{p.CertFile: certPath, p.KeyFile: keyPath} {
			data, err := os.ReadFile(src)
			if err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(dst+".new", data, 0o600); err != nil {
				t.Fatal(err)
			}
			if err := os.Rename(dst+".new", dst); err != nil {
				t.Fatal(err)
			}
		}
	}
	install(first)
	kp, err := LoadKeyPair(certPath, keyPath)
	if err != nil {
		t.Fatal(err)
	}
	reloaded := make(chan struct{}, 1)
	kp.OnReload = func() { reloaded <- struct{}{} }
	cli := &tls.Config{RootCAs: ca.Pool(), ServerName: "localhost", NextProtos: []string{"http/1.1"}}
	if name, err := handshake(t, Server(kp), cli); err != nil || name != "first" {
		t.Fatalf("first handshake: %q, %v", name, err)
	}
	install(second)
	deadline := time.Now().Add(5 * time.Second)
	for {
		name, err := handshake(t, Server(kp), cli)
		if err != nil {
			t.Fatal(err)
		}
		if name == "second" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("still serving %q after rotation", name)
		}
		time.Sleep(100 * time.Millisecond)
	}
	select {
	case <-reloaded:
	default:
		t.Error("OnReload not called")
	}
}

func TestBrokenRotationKeepsServingTheOldPair(t *testing.T) {
	ca := testcerts.NewCA(t, "front")
	good := ca.Server(t, "good")
	other := ca.Server(t, "other")
	kp, err := LoadKeyPair(good.CertFile, good.KeyFile)
	if err != nil {
		t.Fatal(err)
	}
	var reported error
	kp.OnError = func(err error) { reported = err }
	// The key of another certificate: cert and key no longer match.
	if err := os.WriteFile(good.KeyFile, other.KeyPEM, 0o600); err != nil {
		t.Fatal(err)
	}
	kp.checked = time.Time{} // look now
	if got := kp.Current(); got == nil || got.Leaf == nil && len(got.Certificate) == 0 {
		t.Fatal("no certificate in service")
	}
	if reported == nil || !strings.Contains(reported.Error(), "keeping the previous one") {
		t.Fatalf("reported %v", reported)
	}
	cli := &tls.Config{RootCAs: ca.Pool(), ServerName: "localhost"}
	if name, err := handshake(t, Server(kp), cli); err != nil || name != "good" {
		t.Fatalf("handshake after a broken rotation: %q, %v", name, err)
	}
}

func TestLoadKeyPairErrors(t *testing.T) {
	ca := testcerts.NewCA(t, "x")
	p := ca.Server(t, "s")
	q := ca.Server(t, "q")
	if _, err := LoadKeyPair(filepath.Join(t.TempDir(), "missing.pem"), p.KeyFile); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("missing file: %v", err)
	}
	if _, err := LoadKeyPair(p.CertFile, q.KeyFile); err == nil {
		t.Error("mismatched cert and key accepted")
	}
}

func TestClientTrustsGivenCAAndPresentsItsCertificate(t *testing.T) {
	ca := testcerts.NewCA(t, "workers")
	srvPair := ca.Server(t, "worker")
	clientPair := ca.Client(t, "router")
	srv := &tls.Config{Certificates: []tls.Certificate{srvPair.TLS}, ClientCAs: ca.Pool(), ClientAuth: tls.RequireAndVerifyClientCert}

	cli, err := Client(ClientOptions{CACertPaths: []string{ca.CertFile}, ClientCertPath: clientPair.CertFile, ClientKeyPath: clientPair.KeyFile})
	if err != nil {
		t.Fatal(err)
	}
	cli.ServerName = "127.0.0.1"
	if name, err := handshake(t, srv, cli); err != nil || name != "worker" {
		t.Fatalf("mTLS handshake: %q, %v", name, err)
	}

	// Without the CA the worker's certificate is not trusted.
	plain, err := Client(ClientOptions{ClientCertPath: clientPair.CertFile, ClientKeyPath: clientPair.KeyFile})
	if err != nil {
		t.Fatal(err)
	}
	plain.ServerName = "127.0.0.1"
	var unknown *tls.CertificateVerificationError
	if _, err := handshake(t, srv, plain); !errors.As(err, &unknown) {
		t.Errorf("handshake without the CA: %v", err)
	}
}

func TestClientOptionErrors(t *testing.T) {
	ca := testcerts.NewCA(t, "x")
	p := ca.Client(t, "c")
	notPEM := filepath.Join(t.TempDir(), "ca.pem")
	if err := os.WriteFile(notPEM, []byte("hello"), 0o600); err != nil {
		t.Fatal(err)
	}
	for name, o := range map[string]ClientOptions{
		"CA file missing":  {CACertPaths: []string{filepath.Join(t.TempDir(), "none.pem")}},
		"CA not PEM":       {CACertPaths: []string{notPEM}},
		"cert without key": {ClientCertPath: p.CertFile},
		"key without cert": {ClientKeyPath: p.KeyFile},
		"key is not a key": {ClientCertPath: p.CertFile, ClientKeyPath: p.CertFile},
	} {
		if _, err := Client(o); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	if (ClientOptions{}).Enabled() || !(ClientOptions{CACertPaths: []string{"x"}}).Enabled() {
		t.Error("Enabled")
	}
}
