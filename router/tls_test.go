package router

import (
	"context"
	"io"
	"log"
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
