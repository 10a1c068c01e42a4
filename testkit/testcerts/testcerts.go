// Package testcerts makes throwaway certificate authorities and the
// certificates they sign, as PEM files, for TLS tests.
package testcerts

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// CA is a test certificate authority.
type CA struct {
	Cert    *x509.Certificate
	key     *ecdsa.PrivateKey
	CertPEM []byte
	// CertFile holds CertPEM, for --ca-cert-paths and friends.
	CertFile string
	dir      string
}

// Pair is a certificate and its key, in memory and on disk.
type Pair struct {
	CertPEM, KeyPEM   []byte
	CertFile, KeyFile string
	TLS               tls.Certificate
}

// NewCA makes a CA named name whose files live in a test temp dir.
func NewCA(t testing.TB, name string) *CA {
	t.Helper()
	key := newKey(t)
	tmpl := &x509.Certificate{
		SerialNumber:          serial(t),
		Subject:               pkix.Name{CommonName: name},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	ca := &CA{Cert: cert, key: key, CertPEM: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), dir: t.TempDir()}
	ca.CertFile = ca.write(t, name+"-ca.pem", ca.CertPEM)
	return ca
}

// Pool is a cert pool holding only this CA.
func (ca *CA) Pool() *x509.CertPool {
	p := x509.NewCertPool()
	p.AddCert(ca.Cert)
	return p
}

// Server issues a server certificate for the given DNS names and IPs
// ("127.0.0.1", "localhost" by default), written as file name+".pem" and
// name+"-key.pem".
func (ca *CA) Server(t testing.TB, name string, hosts ...string) *Pair {
	t.Helper()
	if len(hosts) == 0 {
		hosts = []string{"127.0.0.1", "::1", "localhost"}
	}
	tmpl := ca.leaf(t, name, x509.ExtKeyUsageServerAuth)
	for _, h := range hosts {
		if ip := net.ParseIP(h); ip != nil {
			tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
		} else {
			tmpl.DNSNames = append(tmpl.DNSNames, h)
		}
	}
	return ca.issue(t, name, tmpl)
}

// Client issues a client certificate with common name name.
func (ca *CA) Client(t testing.TB, name string) *Pair {
	t.Helper()
	return ca.issue(t, name, ca.leaf(t, name, x509.ExtKeyUsageClientAuth))
}

func (ca *CA) leaf(t testing.TB, name string, usage x509.ExtKeyUsage) *x509.Certificate {
	return &x509.Certificate{
		SerialNumber: serial(t),
		Subject:      pkix.Name{CommonName: name},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{usage},
	}
}

func (ca *CA) issue(t testing.TB, name string, tmpl *x509.Certificate) *Pair {
	t.Helper()
	key := newKey(t)
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Cert, &key.PublicKey, ca.key)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	p := &Pair{CertPEM: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		KeyPEM: pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER})}
	if p.TLS, err = tls.X509KeyPair(p.CertPEM, p.KeyPEM); err != nil {
		t.Fatal(err)
	}
	p.CertFile = ca.write(t, name+".pem", p.CertPEM)
	p.KeyFile = ca.write(t, name+"-key.pem", p.KeyPEM)
	return p
}

func (ca *CA) write(t testing.TB, name string, data []byte) string {
	t.Helper()
	path := filepath.Join(ca.dir, name)
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

func newKey(t testing.TB) *ecdsa.PrivateKey {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return key
}

func serial(t testing.TB) *big.Int {
	n, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 62))
	if err != nil {
		t.Fatal(err)
	}
	return n
}
