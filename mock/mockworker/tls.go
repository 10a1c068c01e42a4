package mockworker

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net"
	"os"
)

// TLS serves the mock over HTTPS, like an SGLang engine behind
// --ssl-certfile/--ssl-keyfile; ClientCAFile also requires client
// certificates signed by that CA (mTLS).
type TLS struct {
	CertFile, KeyFile string
	ClientCAFile      string // "" = no client certificate asked for
}

func (t *TLS) config() (*tls.Config, error) {
	cert, err := tls.LoadX509KeyPair(t.CertFile, t.KeyFile)
	if err != nil {
		return nil, fmt.Errorf("mockworker: TLS key pair: %w", err)
	}
	cfg := &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}
	if t.ClientCAFile != "" {
		data, err := os.ReadFile(t.ClientCAFile)
		if err != nil {
			return nil, fmt.Errorf("mockworker: client CA: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(data) {
			return nil, fmt.Errorf("mockworker: client CA %s: no PEM certificate", t.ClientCAFile)
		}
		cfg.ClientCAs, cfg.ClientAuth = pool, tls.RequireAndVerifyClientCert
	}
	return cfg, nil
}

// listen wraps ln in TLS when the config asks for it; on error ln is closed.
func (c *Config) listen(ln net.Listener) (net.Listener, error) {
	if c.TLS == nil {
		return ln, nil
	}
	cfg, err := c.TLS.config()
	if err != nil {
		ln.Close()
		return nil, err
	}
	return tls.NewListener(ln, cfg), nil
}

func (c *Config) scheme() string {
	if c.TLS != nil {
		return "https://"
	}
	return "http://"
}
