// Package routertest serves a router.Server on a loopback port for the
// tests of packages that drive a whole router in process.
package routertest

import (
	"context"
	"net"
	"testing"
	"time"

	"github.com/pdrouter/pdrouter/router"
)

// Serve starts srv on a free loopback port and returns its base URL; the
// router is shut down when the test ends (after cleanups registered later).
func Serve(t testing.TB, srv *router.Server) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	if err := srv.Start(); err != nil {
		ln.Close()
		t.Fatal(err)
	}
	go srv.Serve(ln) //nolint:errcheck // ends at Shutdown
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := srv.Shutdown(ctx); err != nil {
			t.Errorf("router shutdown: %v", err)
		}
	})
	return "http://" + ln.Addr().String()
}
