package e2e

import (
	"context"
	"testing"
	"time"
)

// Issue 26 item 6: with the router's breaker on at its defaults (10
// failures eject for 60 s), a decode kvproxy down for 10 s under steady
// traffic costs about the outage, not the ejection: the decode engine's
// health passes meanwhile, so half-open trials come 1, 2, 4, ... s into
// the ejection, and service returns a few seconds after the restart.
func TestKVProxyRestartBehindBreaker(t *testing.T) {
	c := startCluster(t, opts{transport: "tcp", prefills: 1, decodes: 1, timeouts: "3s", router: true})
	waitRouter(t, c)
	w := &c.decodes[0]
	if err := w.proxy.Cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	w.proxy.Wait(5 * time.Second)
	killed := time.Now()
	for time.Since(killed) < 10*time.Second { // traffic through the outage ejects the decode
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_, _, _ = post(ctx, c.router, body(16, ""))
		cancel()
		time.Sleep(100 * time.Millisecond)
	}
	w.proxy = start(t, nil, "kvproxy ready", "kvproxy", w.proxyArgs...)
	restarted := time.Now()
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		code, out, err := post(ctx, c.router, body(16, ""))
		cancel()
		if err == nil && code == 200 {
			break
		}
		if time.Since(restarted) > 25*time.Second {
			t.Fatalf("not serving 25 s after the restart (the 60 s ejection still running): %d %v %s", code, err, out)
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Logf("serving again %v after the restart, %v after the kill", time.Since(restarted).Round(100*time.Millisecond),
		time.Since(killed).Round(100*time.Millisecond))
}
