package e2e

import (
	"context"
	"testing"
	"time"
)

// A kvproxy killed and started again (same flags, so the same control
// socket and bootstrap port; the peer port is new, as with `make run`)
// serves the engine that kept running: the mock engine dials again and
// registers its pool anew (issue 13 row 12). Requests fail while it is
// down, without hanging. The router's breaker is off: with one worker per
// role, the outage's failures would hold it open past the restart, and the
// breaker is not what this measures.
func TestRestartedKVProxyRestoresService(t *testing.T) {
	c := startCluster(t, opts{transport: "tcp", prefills: 1, decodes: 1, timeouts: "3s", router: true,
		routerArgs: []string{"--disable-circuit-breaker"}})
	waitRouter(t, c)
	cluster := t // the restarted kvproxies live as long as the cluster
	for _, role := range []string{"prefill", "decode"} {
		t.Run(role, func(t *testing.T) {
			w := &c.prefills[0]
			if role == "decode" {
				w = &c.decodes[0]
			}
			if err := w.proxy.Cmd.Process.Kill(); err != nil {
				t.Fatal(err)
			}
			w.proxy.Wait(5 * time.Second)
			killed := time.Now()
			code, out, err := post(context.Background(), c.router, body(64, ""))
			if err != nil || code == 200 || time.Since(killed) > 10*time.Second {
				t.Fatalf("kvproxy down: %d %v %s after %v, want a failure within the 3 s timeouts", code, err, out, time.Since(killed))
			}
			t.Logf("kvproxy down: %d after %v", code, time.Since(killed).Round(time.Millisecond))

			w.proxy = start(cluster, nil, "kvproxy ready", "kvproxy", w.proxyArgs...)
			restarted := time.Now()
			// The decode kvproxy's cache of the prefill's peer address lives
			// 5 s (SGLang's), so a prefill restart can take that long.
			for {
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				code, out, err := post(ctx, c.router, body(64, ""))
				cancel()
				if err == nil && code == 200 {
					break
				}
				if time.Since(restarted) > 10*time.Second {
					t.Fatalf("not serving 10 s after the restart: %d %v %s", code, err, out)
				}
				time.Sleep(100 * time.Millisecond)
			}
			t.Logf("serving again %v after the restart", time.Since(restarted).Round(time.Millisecond))
			for i := range 20 {
				if err := checkOne(c.router, 16+i*100, "tcp"); err != nil {
					t.Fatalf("request %d after the restart: %v", i, err)
				}
			}
			for _, e := range []*worker{&c.prefills[0], &c.decodes[0]} {
				if e.engine.Wait(0) != -1 {
					t.Fatal("a mock engine exited")
				}
			}
		})
	}
}
