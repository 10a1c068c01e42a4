package router

import (
	"context"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
)

// The info client logs a worker's TLS failure once a minute, plain HTTP
// on an https URL included, and passes other errors through silently.
func TestInfoClientLogsTLSFailures(t *testing.T) {
	plain := httptest.NewServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	defer plain.Close()
	secure := httptest.NewUnstartedServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	secure.Config.ErrorLog = log.New(io.Discard, "", 0) // the handshake failures are the point
	secure.StartTLS()
	defer secure.Close()
	core, logs := observer.New(zap.ErrorLevel)
	c := newInfoClient(nil, time.Second, zap.New(core))
	defer c.CloseIdleConnections()
	get := func(url string) error {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		req, _ := http.NewRequestWithContext(ctx, "GET", url, nil)
		resp, err := c.Do(req)
		if err == nil {
			resp.Body.Close()
		}
		return err
	}
	for range 2 {
		if err := get(secure.URL); err == nil { // httptest's certificate is not trusted
			t.Fatal("untrusted certificate accepted")
		}
	}
	if err := get("https://" + plain.Listener.Addr().String()); err == nil {
		t.Fatal("plain HTTP accepted as https")
	}
	if err := get("http://127.0.0.1:1"); err == nil {
		t.Fatal("closed port answered")
	}
	if n := logs.FilterMessageSnippet("worker TLS failed").Len(); n != 2 {
		t.Errorf("%d TLS failure lines, want 2 (one per worker, once a minute): %v", n, logs.All())
	}
}

// Issue 26: a worker that drops the TLS handshake with a bare EOF (as an
// mTLS worker may when no client certificate is sent) made probes fail
// with "EOF" and logged nothing; it is logged as the TLS failure it is.
func TestInfoClientLogsBareEOFHandshake(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Read(make([]byte, 512)) // the ClientHello, then nothing
			c.Close()
		}
	}()
	core, logs := observer.New(zap.ErrorLevel)
	c := newInfoClient(nil, time.Second, zap.New(core))
	defer c.CloseIdleConnections()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, "GET", "https://"+ln.Addr().String()+"/health", nil)
	if resp, err := c.Do(req); err == nil {
		resp.Body.Close()
		t.Fatal("a dropped handshake answered")
	}
	if n := logs.FilterMessageSnippet("worker TLS failed").Len(); n != 1 {
		t.Errorf("%d TLS failure lines, want 1: %v", n, logs.All())
	}
}
