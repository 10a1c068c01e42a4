// Package grafana checks deploy/grafana/pdrouter.json against what the
// router and kvproxy really export.
package grafana

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/pdrouter/pdrouter/k8sdiscovery"
	"github.com/pdrouter/pdrouter/kvtransfer/sidecar"
	"github.com/pdrouter/pdrouter/mock/enginesim"
	"github.com/pdrouter/pdrouter/mock/mockworker"
	"github.com/pdrouter/pdrouter/router"
	"github.com/pdrouter/pdrouter/testkit/routertest"
)

// metricName finds the series names in a PromQL expression.
var metricName = regexp.MustCompile(`\b(smg|pdrouter|kvproxy)_[a-zA-Z0-9_]+`)

func dashboardMetrics(t *testing.T) []string {
	t.Helper()
	b, err := os.ReadFile("pdrouter.json")
	if err != nil {
		t.Fatal(err)
	}
	var d struct {
		Panels []struct {
			Title   string
			Targets []struct{ Expr string }
		}
	}
	if err := json.Unmarshal(b, &d); err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for _, p := range d.Panels {
		for _, tg := range p.Targets {
			for _, m := range metricName.FindAllString(tg.Expr, -1) {
				seen[m] = true
			}
		}
	}
	names := slices.Sorted(func(yield func(string) bool) {
		for n := range seen {
			if !yield(n) {
				return
			}
		}
	})
	if len(names) < 20 {
		t.Fatalf("only %d metric names in the dashboard: %v", len(names), names)
	}
	return names
}

// exported lists the series names on a /metrics page.
func exported(t *testing.T, url string) map[string]bool {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	names := map[string]bool{}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || line[0] == '#' {
			continue
		}
		if i := strings.IndexAny(line, "{ "); i > 0 {
			names[line[:i]] = true
		}
	}
	return names
}

// The router's /metrics and two kvproxies' after PD traffic with real KV
// transfers, a failing worker (errors, retries, breaker) and discovered
// pods that come and go; every name the dashboard queries must be there.
func TestDashboardMetricsExist(t *testing.T) {
	dir := t.TempDir()
	type side struct {
		proxy  *sidecar.Sidecar
		worker *mockworker.Server
	}
	start := func(role string) side {
		sock := filepath.Join(dir, role+".sock")
		sc, err := sidecar.Start(sidecar.Config{Role: role, Transport: "tcp", Control: sock, Host: "127.0.0.1"})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { sc.Close() })
		sim, err := enginesim.New(context.Background(), enginesim.Options{Control: sock, Layers: 2, BuffersPerLay: 2,
			BytesPerToken: 64, PageSize: 16, PoolTokens: 65536, ChunkTokens: 4096, AuxSlots: 64, QueueTimeout: 5 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { sim.Close() })
		w, err := mockworker.Start(mockworker.Config{Role: mockworker.Role(role), KV: sim, Tokens: 4})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { w.Close() })
		return side{sc, w}
	}
	p, d := start("prefill"), start("decode")
	bad, err := mockworker.Start(mockworker.Config{Role: mockworker.RoleDecode, StatusCode: 500})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { bad.Close() })
	_, bootPort, _ := net.SplitHostPort(p.proxy.Addrs().Bootstrap)
	boot, _ := strconv.Atoi(bootPort)

	reg := prometheus.NewRegistry()
	cfg := router.DefaultConfig()
	cfg.PDDisaggregation = true
	cfg.Policy = "round_robin"
	cfg.Prefill = []router.PrefillSpec{{URL: p.worker.URL(), BootstrapPort: boot}}
	cfg.Decode = []string{d.worker.URL(), bad.URL()}
	cfg.Retry.InitialBackoff, cfg.Retry.MaxBackoff = time.Millisecond, time.Millisecond
	cfg.Manager.Breaker.FailureThreshold = 2
	cfg.Manager.Health.Interval = 50 * time.Millisecond
	srv, err := router.New(cfg, zap.NewNop(), reg)
	if err != nil {
		t.Fatal(err)
	}
	base := routertest.Serve(t, srv)
	metrics := &http.Server{Handler: promhttp.HandlerFor(reg, promhttp.HandlerOpts{}), ReadHeaderTimeout: 5 * time.Second}
	mln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go metrics.Serve(mln) //nolint:errcheck // ends at Close
	t.Cleanup(func() { metrics.Close() })

	// Discovery's series, from a pod that joins and leaves.
	dm, err := k8sdiscovery.NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	cs := fake.NewClientset()
	disc, err := k8sdiscovery.New(k8sdiscovery.Config{Selector: map[string]string{"app": "x"}, Port: 1},
		noWatchList{cs.CoreV1().Pods("")}, srv.Manager(), nil, dm)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); disc.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "a", Namespace: "n", Labels: map[string]string{"app": "x"}},
		Status: corev1.PodStatus{Phase: corev1.PodRunning, PodIP: "127.0.0.1",
			Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}}}}
	if _, err := cs.CoreV1().Pods("n").Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}

	for deadline := time.Now().Add(10 * time.Second); !srv.Manager().Ready(); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("router not ready")
		}
	}
	ok := 0
	for i := range 12 {
		body := `{"input_ids":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17],"sampling_params":{"max_new_tokens":4},"stream":` +
			strconv.FormatBool(i%2 == 0) + `}`
		resp, err := http.Post(base+"/generate", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body) //nolint:errcheck // status is what counts
		resp.Body.Close()
		if resp.StatusCode == 200 {
			ok++
		}
	}
	if ok == 0 {
		t.Fatal("no request got through")
	}
	// Only the failing decode left: every attempt fails, retries run out.
	if _, removed := srv.Manager().Remove(d.worker.URL()); !removed {
		t.Fatal("could not remove the good decode")
	}
	resp, err := http.Post(base+"/generate", "application/json", strings.NewReader(`{"text":"x"}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode == 200 {
		t.Fatal("a request succeeded on the failing decode alone")
	}
	if err := cs.CoreV1().Pods("n").Delete(ctx, "a", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}

	time.Sleep(100 * time.Millisecond) // a health check round
	have := exported(t, "http://"+mln.Addr().String()+"/metrics")
	for _, s := range []side{p, d} {
		for n := range exported(t, "http://"+s.proxy.Addrs().Metrics+"/metrics") {
			have[n] = true
		}
	}
	for deadline := time.Now().Add(5 * time.Second); !have["smg_discovery_deregistrations_total"] && time.Now().Before(deadline); {
		time.Sleep(20 * time.Millisecond)
		for n := range exported(t, "http://"+mln.Addr().String()+"/metrics") {
			have[n] = true
		}
	}
	for _, name := range dashboardMetrics(t) {
		if !have[name] {
			t.Errorf("the dashboard queries %s, which neither the router nor kvproxy exports", name)
		}
	}
}

type noWatchList struct{ k8sdiscovery.Pods }

func (noWatchList) IsWatchListSemanticsUnSupported() bool { return true }
