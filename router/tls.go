package router

import (
	"crypto/tls"
	"errors"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"syscall"
	"time"

	"go.uber.org/zap"

	"github.com/pdrouter/pdrouter/internal/tlsconfig"
)

// validSecurity checks the TLS and control-plane settings; the files
// themselves are read by New.
func (c Config) validSecurity() error {
	if (c.TLSCertPath == "") != (c.TLSKeyPath == "") {
		return invalid("--tls-cert-path and --tls-key-path must be given together")
	}
	if (c.WorkerTLS.ClientCertPath == "") != (c.WorkerTLS.ClientKeyPath == "") {
		return invalid("--client-cert-path and --client-key-path must be given together")
	}
	if err := c.ControlPlane.Validate(); err != nil {
		return invalid("%s", err)
	}
	return nil
}

// secure loads what the TLS settings name: the front end's key pair and
// the worker TLS config. Any failure stops New.
func (s *Server) secure() error {
	cfg := &s.cfg
	if cfg.TLSCertPath != "" {
		kp, err := tlsconfig.LoadKeyPair(cfg.TLSCertPath, cfg.TLSKeyPath)
		if err != nil {
			return err
		}
		kp.OnError = func(err error) { s.log.Error("HTTPS certificate rotation failed", zap.Error(err)) }
		kp.OnReload = func() { s.log.Info("HTTPS certificate reloaded", zap.String("cert", cfg.TLSCertPath)) }
		s.frontTLS = tlsconfig.Server(kp)
	}
	if cfg.WorkerTLS.Enabled() {
		var err error
		if s.workerTLS, err = tlsconfig.Client(cfg.WorkerTLS); err != nil {
			return err
		}
	}
	return nil
}

// listener serves TLS on ln when --tls-cert-path is set.
func (s *Server) listener(ln net.Listener) net.Listener {
	if s.frontTLS == nil {
		return ln
	}
	return tls.NewListener(ln, s.frontTLS)
}

// TLS reports whether the front end serves HTTPS.
func (s *Server) TLS() bool { return s.frontTLS != nil }

// workerTLSFor is the config of one TLS dial to a worker: the worker TLS
// flags' (or the system roots), verified against serverName.
func workerTLSFor(base *tls.Config, serverName string) *tls.Config {
	if base == nil {
		return &tls.Config{ServerName: serverName, MinVersion: tls.VersionTLS12}
	}
	c := base.Clone()
	c.ServerName = serverName
	return c
}

// newInfoClient serves the info endpoints, their fan-out to every worker
// and the manager's probes, where convenience matters more than speed.
// workerTLS nil = the system roots. TLS failures are logged: a probe only
// sees "unhealthy", and the log has to say why.
func newInfoClient(workerTLS *tls.Config, idle time.Duration, log *zap.Logger) *http.Client {
	tr := &http.Transport{MaxIdleConnsPerHost: 4, IdleConnTimeout: idle, TLSClientConfig: workerTLS, TLSHandshakeTimeout: 10 * time.Second}
	return &http.Client{Transport: &tlsErrorLog{base: tr, log: log, last: map[string]time.Time{}}}
}

// tlsErrorLog logs a worker's TLS failures, once a minute per worker.
type tlsErrorLog struct {
	base *http.Transport
	log  *zap.Logger
	mu   sync.Mutex
	last map[string]time.Time // by host:port
}

func (t *tlsErrorLog) RoundTrip(r *http.Request) (*http.Response, error) {
	resp, err := t.base.RoundTrip(r)
	if err != nil && (isTLSError(err) || r.URL.Scheme == "https" && droppedHandshake(err)) && t.due(r.URL.Host) {
		t.log.Error("worker TLS failed: check --ca-cert-paths, --client-cert-path and the worker's certificate",
			zap.String("worker", r.URL.Scheme+"://"+r.URL.Host), zap.Error(err))
	}
	return resp, err
}

// CloseIdleConnections lets http.Client.CloseIdleConnections reach the transport.
func (t *tlsErrorLog) CloseIdleConnections() { t.base.CloseIdleConnections() }

func (t *tlsErrorLog) due(host string) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if time.Since(t.last[host]) < time.Minute {
		return false
	}
	t.last[host] = time.Now()
	return true
}

// droppedHandshake is a connection closed without a TLS alert before any
// reply: an mTLS worker may drop a client that sent no certificate so.
func droppedHandshake(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, syscall.ECONNRESET)
}

func isTLSError(err error) bool {
	var verify *tls.CertificateVerificationError
	var header tls.RecordHeaderError
	if errors.As(err, &verify) || errors.As(err, &header) {
		return true
	}
	// Alerts from the worker (e.g. "remote error: tls: certificate required") have no exported type.
	msg := err.Error()
	return strings.Contains(msg, "tls: ") || strings.Contains(msg, "x509: ") ||
		strings.Contains(msg, "HTTP response to HTTPS client")
}
