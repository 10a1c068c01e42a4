// Package tlsconfig builds pdrouter's TLS configurations: the HTTPS front
// end (--tls-cert-path/--tls-key-path), whose certificate is reloaded when
// its files change, and the client side towards workers (--ca-cert-paths,
// --client-cert-path/--client-key-path), shared by every connection the
// router makes to them.
package tlsconfig

import (
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"sync"
	"time"
)

// checkEvery bounds how often a handshake looks at the certificate files:
// a rotation is picked up within this long, and a busy listener does not
// stat twice per connection.
const checkEvery = time.Second

// KeyPair is a certificate and key read from PEM files and read again when
// either file changes (a Kubernetes secret update swaps the files behind a
// symlink). A pair that fails to load keeps the last good one in service;
// OnError hears about it.
type KeyPair struct {
	certPath, keyPath string
	// OnError is told when a changed pair fails to load; nil = silent.
	OnError func(error)
	// OnReload is told when a new pair has been loaded; nil = silent.
	OnReload func()

	mu      sync.Mutex
	cert    *tls.Certificate
	stamp   [2]fileStamp
	checked time.Time
}

type fileStamp struct {
	mod  time.Time
	size int64
}

// LoadKeyPair reads the pair now; a bad pair at start-up is an error.
func LoadKeyPair(certPath, keyPath string) (*KeyPair, error) {
	kp := &KeyPair{certPath: certPath, keyPath: keyPath}
	stamp, err := kp.stat()
	if err != nil {
		return nil, err
	}
	cert, err := tls.LoadX509KeyPair(certPath, keyPath)
	if err != nil {
		return nil, fmt.Errorf("load TLS key pair %s, %s: %w", certPath, keyPath, err)
	}
	kp.cert, kp.stamp, kp.checked = &cert, stamp, time.Now()
	return kp, nil
}

func (kp *KeyPair) stat() ([2]fileStamp, error) {
	var st [2]fileStamp
	for i, p := range []string{kp.certPath, kp.keyPath} {
		fi, err := os.Stat(p) // follows symlinks: a swapped target is a change
		if err != nil {
			return st, fmt.Errorf("TLS file: %w", err)
		}
		st[i] = fileStamp{fi.ModTime(), fi.Size()}
	}
	return st, nil
}

// Current returns the pair in service, first reloading it if the files
// changed since the last look (at most once per checkEvery).
func (kp *KeyPair) Current() *tls.Certificate {
	kp.mu.Lock()
	defer kp.mu.Unlock()
	if time.Since(kp.checked) < checkEvery {
		return kp.cert
	}
	kp.checked = time.Now()
	stamp, err := kp.stat()
	if err != nil || stamp == kp.stamp {
		return kp.cert // a file missing mid-swap: keep serving, look again later
	}
	cert, err := tls.LoadX509KeyPair(kp.certPath, kp.keyPath)
	if err != nil {
		// The cert and key may be written one after the other: keep the
		// stamp so the next look retries.
		if kp.OnError != nil {
			kp.OnError(fmt.Errorf("reload TLS key pair %s, %s (keeping the previous one): %w", kp.certPath, kp.keyPath, err))
		}
		return kp.cert
	}
	kp.cert, kp.stamp = &cert, stamp
	if kp.OnReload != nil {
		kp.OnReload()
	}
	return kp.cert
}

// Server is the front end's TLS config: TLS 1.2+, HTTP/1.1 by ALPN (the
// router speaks no HTTP/2), certificate from kp.
func Server(kp *KeyPair) *tls.Config {
	return &tls.Config{
		MinVersion: tls.VersionTLS12,
		NextProtos: []string{"http/1.1"},
		GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) {
			return kp.Current(), nil
		},
	}
}

// ClientOptions are the worker-side TLS flags.
type ClientOptions struct {
	CACertPaths    []string // PEM bundles trusted besides the system roots
	ClientCertPath string   // with ClientKeyPath: the certificate presented to workers
	ClientKeyPath  string
}

// Enabled reports whether any worker TLS option is set.
func (o ClientOptions) Enabled() bool {
	return len(o.CACertPaths) > 0 || o.ClientCertPath != "" || o.ClientKeyPath != ""
}

// Client builds the config for https workers: the system roots plus
// CACertPaths, and the client certificate when one is given (reloaded like
// the server's). Every file is read now, so a bad path fails start-up.
// The caller sets ServerName per worker (Clone, or net/http does it).
func Client(o ClientOptions) (*tls.Config, error) {
	cfg := &tls.Config{MinVersion: tls.VersionTLS12, NextProtos: []string{"http/1.1"}}
	if len(o.CACertPaths) > 0 {
		pool, err := x509.SystemCertPool()
		if err != nil {
			pool = x509.NewCertPool()
		}
		for _, p := range o.CACertPaths {
			if err := addPEM(pool, p); err != nil {
				return nil, err
			}
		}
		cfg.RootCAs = pool
	}
	if (o.ClientCertPath == "") != (o.ClientKeyPath == "") {
		return nil, errors.New("client certificate and key must be given together")
	}
	if o.ClientCertPath != "" {
		kp, err := LoadKeyPair(o.ClientCertPath, o.ClientKeyPath)
		if err != nil {
			return nil, err
		}
		cfg.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
			return kp.Current(), nil
		}
	}
	return cfg, nil
}

func addPEM(pool *x509.CertPool, path string) error {
	data, err := os.ReadFile(path)
	if err != nil {
		return fmt.Errorf("CA certificate: %w", err)
	}
	if !bytes.Contains(data, []byte("-----BEGIN CERTIFICATE-----")) || !pool.AppendCertsFromPEM(data) {
		return fmt.Errorf("CA certificate %s: no PEM certificate in it", path)
	}
	return nil
}
