package k8sdiscovery_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/goleak"
	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/pdrouter/pdrouter/balancer"
	"github.com/pdrouter/pdrouter/k8sdiscovery"
	"github.com/pdrouter/pdrouter/mock/mockworker"
	"github.com/pdrouter/pdrouter/router"
	"github.com/pdrouter/pdrouter/testkit/routertest"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// klog's flush daemon and fasthttp's date updater are process-wide.
		goleak.IgnoreAnyFunction("k8s.io/klog/v2.(*flushDaemon).run.func1"),
		goleak.IgnoreAnyFunction("github.com/valyala/fasthttp.updateServerDate.func1"),
		goleak.IgnoreAnyFunction("github.com/valyala/fasthttp.(*workerPool).Start.func2"))
}

const ns = "llm"

// step is how long the registry may lag a pod change.
const step = time.Second

// engines starts n mock engines on 127.0.0.2, 127.0.0.3, ... sharing one
// port, as pods share --service-discovery-port.
func engines(t *testing.T, roles ...mockworker.Role) (port int, ips []string) {
	port, ips, _ = enginesRec(t, roles...)
	return port, ips
}

// enginesRec is engines, also returning the servers (for their recordings).
func enginesRec(t *testing.T, roles ...mockworker.Role) (port int, ips []string, servers []*mockworker.Server) {
	t.Helper()
	for attempt := 0; attempt < 10; attempt++ {
		ln, err := net.Listen("tcp", "127.0.0.2:0")
		if err != nil {
			t.Fatal(err)
		}
		port = ln.Addr().(*net.TCPAddr).Port
		ln.Close()
		var started []*mockworker.Server
		ips = nil
		for i, role := range roles {
			ip := "127.0.0." + strconv.Itoa(i+2)
			s, err := mockworker.Start(mockworker.Config{Role: role, Host: ip, Port: port, WorkerID: ip})
			if err != nil {
				break
			}
			started = append(started, s)
			ips = append(ips, ip)
		}
		if len(started) == len(roles) {
			for _, s := range started {
				t.Cleanup(func() { s.Close() })
			}
			return port, ips, started
		}
		for _, s := range started {
			s.Close()
		}
	}
	t.Fatal("no port free on every loopback address")
	return 0, nil, nil
}

func url(ip string, port int) string { return "http://" + ip + ":" + strconv.Itoa(port) }

// cluster is a fake API server (client-go's fake clientset) and a router
// whose workers discovery keeps in step with it.
type cluster struct {
	t       *testing.T
	cs      *fake.Clientset
	srv     *router.Server
	base    string
	disc    *k8sdiscovery.Discovery
	metrics *prometheus.Registry
}

// noWatchList turns client-go's streaming list off: the fake clientset
// cannot serve it (client-go asks fakes to say so).
type noWatchList struct{ k8sdiscovery.Pods }

func (noWatchList) IsWatchListSemanticsUnSupported() bool { return true }

func newCluster(t *testing.T, cfg k8sdiscovery.Config, tweak func(*router.Config), objects ...runtime.Object) *cluster {
	t.Helper()
	return newClusterWith(t, cfg, tweak, nil, objects...)
}

// newClusterWith is newCluster with prepare run on the clientset before
// discovery starts (reactors installed later could miss the first watch).
func newClusterWith(t *testing.T, cfg k8sdiscovery.Config, tweak func(*router.Config), prepare func(*fake.Clientset), objects ...runtime.Object) *cluster {
	t.Helper()
	c := &cluster{t: t, cs: fake.NewClientset(objects...), metrics: prometheus.NewRegistry()}
	if prepare != nil {
		prepare(c.cs)
	}
	rc := router.DefaultConfig()
	rc.PDDisaggregation = cfg.PD
	rc.Policy = "round_robin"
	rc.Manager.Health.Disabled = true // joining is still gated on /health
	if tweak != nil {
		tweak(&rc)
	}
	srv, err := router.New(rc, zap.NewNop(), c.metrics)
	if err != nil {
		t.Fatal(err)
	}
	c.srv, c.base = srv, routertest.Serve(t, srv)

	metrics, err := k8sdiscovery.NewMetrics(c.metrics)
	if err != nil {
		t.Fatal(err)
	}
	cfg.Namespace = ns
	c.disc, err = k8sdiscovery.New(cfg, noWatchList{c.cs.CoreV1().Pods(ns)}, srv.Manager(), zap.NewNop(), metrics)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); c.disc.Run(ctx) }()
	t.Cleanup(func() { // before the router's shutdown, registered earlier
		cancel()
		<-done
	})
	return c
}

type podSpec struct {
	name, ip    string
	labels      map[string]string
	annotations map[string]string
	phase       corev1.PodPhase
	ready       bool
}

func (p podSpec) pod() *corev1.Pod {
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: p.name, Namespace: ns, Labels: p.labels, Annotations: p.annotations},
		Status:     corev1.PodStatus{Phase: p.phase, PodIP: p.ip},
	}
	if pod.Status.Phase == "" {
		pod.Status.Phase = corev1.PodRunning
	}
	status := corev1.ConditionFalse
	if p.ready {
		status = corev1.ConditionTrue
	}
	pod.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodScheduled, Status: corev1.ConditionTrue}, {Type: corev1.PodReady, Status: status}}
	return pod
}

func (c *cluster) create(p podSpec) {
	c.t.Helper()
	if _, err := c.cs.CoreV1().Pods(ns).Create(context.Background(), p.pod(), metav1.CreateOptions{}); err != nil {
		c.t.Fatal(err)
	}
}

func (c *cluster) update(p podSpec) {
	c.t.Helper()
	if _, err := c.cs.CoreV1().Pods(ns).Update(context.Background(), p.pod(), metav1.UpdateOptions{}); err != nil {
		c.t.Fatal(err)
	}
}

func (c *cluster) delete(name string) {
	c.t.Helper()
	if err := c.cs.CoreV1().Pods(ns).Delete(context.Background(), name, metav1.DeleteOptions{}); err != nil {
		c.t.Fatal(err)
	}
}

// worker is a worker as GET /workers shows it.
type worker struct {
	URL           string            `json:"url"`
	WorkerType    string            `json:"worker_type"`
	BootstrapPort *int              `json:"bootstrap_port"`
	Metadata      map[string]string `json:"metadata"`
}

func (w worker) String() string {
	s := w.WorkerType + " " + w.URL
	if w.BootstrapPort != nil {
		s += " bootstrap=" + strconv.Itoa(*w.BootstrapPort)
	}
	return s
}

func (c *cluster) workers() []string {
	c.t.Helper()
	out := []string{}
	for _, w := range c.workersFull() {
		out = append(out, w.String())
	}
	slices.Sort(out)
	return out
}

// registry lists the router's registry directly, in the same form.
func (c *cluster) registry() []string {
	out := []string{}
	for _, w := range c.srv.Registry().Snapshot().All {
		wi := w.Info()
		out = append(out, worker{URL: wi.URL, WorkerType: wi.WorkerType, BootstrapPort: wi.BootstrapPort}.String())
	}
	slices.Sort(out)
	return out
}

// expect waits up to step for /workers and the registry to list exactly want.
func (c *cluster) expect(what string, want ...string) {
	c.t.Helper()
	slices.Sort(want)
	if want == nil {
		want = []string{}
	}
	deadline := time.Now().Add(step)
	for {
		got, reg := c.workers(), c.registry()
		if slices.Equal(got, want) && slices.Equal(reg, want) {
			return
		}
		if time.Now().After(deadline) {
			c.t.Fatalf("%s: /workers %q, registry %q, want %q within %v", what, got, reg, want, step)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// stays checks that /workers keeps listing want for a while: for steps
// where nothing should happen.
func (c *cluster) stays(what string, want ...string) {
	c.t.Helper()
	c.expect(what, want...)
	time.Sleep(200 * time.Millisecond)
	c.expect(what, want...)
}

func (c *cluster) counter(name string, labels ...string) float64 {
	c.t.Helper()
	mfs, err := c.metrics.Gather()
	if err != nil {
		c.t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	next:
		for _, m := range mf.Metric {
			for i := 0; i+1 < len(labels); i += 2 {
				found := false
				for _, lp := range m.Label {
					found = found || (lp.GetName() == labels[i] && lp.GetValue() == labels[i+1])
				}
				if !found {
					continue next
				}
			}
			if m.Counter != nil {
				return m.Counter.GetValue()
			}
			return m.Gauge.GetValue()
		}
	}
	return 0
}

var app = map[string]string{"app": "engine"}

func TestRegularPodLifecycle(t *testing.T) {
	port, ips := engines(t, mockworker.RoleRegular, mockworker.RoleRegular)
	c := newCluster(t, k8sdiscovery.Config{Selector: app, Port: port}, nil)
	a := podSpec{name: "a", labels: app}
	u := url(ips[0], port)
	regular := "regular " + u

	c.create(a)
	c.stays("pending pod without IP")
	a.ip = ips[0]
	c.update(a)
	c.stays("running, not ready")
	a.ready = true
	c.update(a)
	c.expect("ready", regular)
	a.phase = corev1.PodSucceeded
	c.update(a)
	c.expect("no longer running")
	a.phase = corev1.PodRunning
	c.update(a)
	c.expect("running again", regular)
	a.ready = false
	c.update(a)
	c.expect("unready")
	a.ready = true
	c.update(a)
	c.expect("ready again", regular)

	a.labels = map[string]string{"app": "other"}
	c.update(a)
	c.expect("relabelled out of the selector")
	a.labels = map[string]string{"app": "engine", "extra": "x"}
	c.update(a)
	c.expect("relabelled back (extra labels do not matter)", regular)

	b := podSpec{name: "b", ip: ips[1], labels: app, ready: true}
	c.create(b)
	c.expect("second pod", regular, "regular "+url(ips[1], port))
	c.delete("b")
	c.expect("second pod deleted", regular)

	// Termination: the deletion timestamp comes before the pod goes.
	pod := a.pod()
	now := metav1.Now()
	pod.DeletionTimestamp = &now
	if _, err := c.cs.CoreV1().Pods(ns).Update(context.Background(), pod, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	c.expect("terminating")
	c.delete("a")
	c.stays("deleted")

	if got := c.counter("smg_discovery_registrations_total", "result", "success"); got != 5 {
		t.Errorf("registrations: %v, want 5", got)
	}
	if got := c.counter("smg_discovery_deregistrations_total", "reason", "pod_deleted"); got != 2 {
		t.Errorf("pod_deleted deregistrations: %v, want 2 (b, terminating a)", got)
	}
	if got := c.counter("smg_discovery_deregistrations_total", "reason", "reconciled"); got != 3 {
		t.Errorf("reconciled deregistrations: %v, want 3 (not running, unready, relabelled)", got)
	}
}

func TestPDRolesAndBootstrapAnnotation(t *testing.T) {
	port, ips, servers := enginesRec(t, mockworker.RolePrefill, mockworker.RolePrefill, mockworker.RoleDecode, mockworker.RolePrefill, mockworker.RolePrefill)
	prefill := map[string]string{"app": "sglang", "component": "prefill"}
	decode := map[string]string{"app": "sglang", "component": "decode"}
	both := map[string]string{"app": "sglang", "component": "prefill", "role": "decode"}
	c := newCluster(t, k8sdiscovery.Config{PD: true, PrefillSelector: prefill,
		DecodeSelector: map[string]string{"app": "sglang", "role": "decode"}, Port: port}, nil)
	u := func(i int) string { return url(ips[i], port) }
	ann := func(v string) map[string]string { return map[string]string{k8sdiscovery.BootstrapPortAnnotation: v} }

	c.create(podSpec{name: "p0", ip: ips[0], labels: prefill, annotations: ann("9001"), ready: true})
	c.create(podSpec{name: "p1", ip: ips[1], labels: prefill, ready: true})
	c.create(podSpec{name: "d0", ip: ips[2], labels: map[string]string{"app": "sglang", "role": "decode"},
		annotations: ann("9009"), ready: true})
	c.create(podSpec{name: "both", ip: ips[3], labels: both, annotations: ann("9003"), ready: true})
	c.create(podSpec{name: "bad", ip: ips[4], labels: prefill, annotations: ann("not-a-port"), ready: true})
	c.expect("roles from the two selectors",
		"prefill "+u(0)+" bootstrap=9001",
		"prefill "+u(1),                   // no annotation: no bootstrap port, JSON null
		"decode "+u(2),                    // the annotation only means something on prefills
		"prefill "+u(3)+" bootstrap=9003", // both selectors: prefill, as in sglang-router
		"prefill "+u(4),                   // unparsable annotation: none
	)

	// A request through the router carries the annotation's port, or null.
	for range 10 { // round robin visits every prefill
		resp, err := http.Post(c.base+"/generate", "application/json", strings.NewReader(`{"text":"hi"}`))
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("generate: %d %s", resp.StatusCode, b)
		}
	}
	sent := map[string]string{}
	for _, r := range servers[2].Requests() { // the decode engine
		var host string
		json.Unmarshal(r.BootstrapHost, &host) //nolint:errcheck // compared below
		sent[host] = string(r.BootstrapPort)
	}
	want := map[string]string{ips[0]: "9001", ips[1]: "null", ips[3]: "9003", ips[4]: "null"}
	if !maps.Equal(sent, want) {
		t.Errorf("bootstrap_host → bootstrap_port sent to decode: %v, want %v", sent, want)
	}

	// The annotation changes: the worker is registered again with it.
	c.update(podSpec{name: "p1", ip: ips[1], labels: prefill, annotations: ann("9002"), ready: true})
	c.expect("annotated", "prefill "+u(0)+" bootstrap=9001", "prefill "+u(1)+" bootstrap=9002",
		"decode "+u(2), "prefill "+u(3)+" bootstrap=9003", "prefill "+u(4))
	// Relabelled from prefill to decode: it changes role.
	c.update(podSpec{name: "p0", ip: ips[0], labels: decode, annotations: ann("9001"), ready: true})
	c.expect("prefill relabelled to neither (component=decode is not the decode selector)",
		"prefill "+u(1)+" bootstrap=9002", "decode "+u(2), "prefill "+u(3)+" bootstrap=9003", "prefill "+u(4))
	c.update(podSpec{name: "p0", ip: ips[0], labels: map[string]string{"app": "sglang", "role": "decode"}, ready: true})
	c.expect("relabelled to decode", "decode "+u(0),
		"prefill "+u(1)+" bootstrap=9002", "decode "+u(2), "prefill "+u(3)+" bootstrap=9003", "prefill "+u(4))

	for _, w := range c.workersFull() {
		if w.Metadata["k8s_namespace"] != ns || w.Metadata["k8s_pod"] == "" {
			t.Errorf("%s: metadata %v, want the pod's namespace and name", w.URL, w.Metadata)
		}
	}
}

func (c *cluster) workersFull() []worker {
	c.t.Helper()
	resp, err := http.Get(c.base + "/workers")
	if err != nil {
		c.t.Fatal(err)
	}
	defer resp.Body.Close()
	var body struct {
		Workers []worker `json:"workers"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
		c.t.Fatal(err)
	}
	return body.Workers
}

// A watch that breaks makes the informer list again: pods deleted while the
// watch was down leave, pods created meanwhile join.
func TestRelistAfterWatchError(t *testing.T) {
	port, ips := engines(t, mockworker.RoleRegular, mockworker.RoleRegular, mockworker.RoleRegular)
	a := podSpec{name: "a", ip: ips[0], labels: app, ready: true}
	b := podSpec{name: "b", ip: ips[1], labels: app, ready: true}
	// Watches answer from our own channels, so changes made through the
	// clientset reach the informer only by listing.
	var mu sync.Mutex
	var watches []*watch.RaceFreeFakeWatcher
	c := newClusterWith(t, k8sdiscovery.Config{Selector: app, Port: port}, nil, func(cs *fake.Clientset) {
		cs.PrependWatchReactor("pods", func(k8stesting.Action) (bool, watch.Interface, error) {
			w := watch.NewRaceFreeFake()
			mu.Lock()
			watches = append(watches, w)
			mu.Unlock()
			return true, w, nil
		})
	}, a.pod(), b.pod())
	current := func() (*watch.RaceFreeFakeWatcher, int) {
		mu.Lock()
		defer mu.Unlock()
		if len(watches) == 0 {
			return nil, 0
		}
		return watches[len(watches)-1], len(watches)
	}
	c.expect("initial list", "regular "+url(ips[0], port), "regular "+url(ips[1], port))
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if w, _ := current(); w != nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the informer never watched")
		}
	}

	c.delete("a")
	c.create(podSpec{name: "c", ip: ips[2], labels: app, ready: true})
	c.stays("changes not watched yet", "regular "+url(ips[0], port), "regular "+url(ips[1], port))

	w, n := current()
	w.Error(&apierrors.NewResourceExpired("too old resource version").ErrStatus)
	// The reflector waits its backoff (0.8-1.6 s) before listing again.
	deadline := time.Now().Add(5 * time.Second)
	for {
		if _, m := current(); m > n {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("no new watch after the error")
		}
		time.Sleep(10 * time.Millisecond)
	}
	c.expect("after the re-list", "regular "+url(ips[1], port), "regular "+url(ips[2], port))

	// The new watch delivers events again.
	w, _ = current()
	pod := b.pod()
	pod.Status.Conditions[1].Status = corev1.ConditionFalse
	w.Modify(pod)
	c.expect("unready through the new watch", "regular "+url(ips[2], port))
}

// Workers added through the admin API or the command line stay beside the
// discovered ones, even when a pod has the same URL.
func TestAdminWorkersStayBeside(t *testing.T) {
	port, ips := engines(t, mockworker.RoleRegular, mockworker.RoleRegular, mockworker.RoleRegular)
	c := newCluster(t, k8sdiscovery.Config{Selector: app, Port: port}, func(rc *router.Config) {
		rc.WorkerURLs = []string{url(ips[2], port)}
	})
	c.expect("command-line worker", "regular "+url(ips[2], port))
	post := func(u string) {
		resp, err := http.Post(c.base+"/workers", "application/json", strings.NewReader(`{"url":"`+u+`"}`))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != 202 {
			t.Fatalf("POST /workers: %d", resp.StatusCode)
		}
	}
	post(url(ips[0], port))
	c.expect("admin worker", "regular "+url(ips[0], port), "regular "+url(ips[2], port))

	c.create(podSpec{name: "a", ip: ips[0], labels: app, ready: true}) // same URL as the admin's
	c.create(podSpec{name: "b", ip: ips[1], labels: app, ready: true})
	all := []string{"regular " + url(ips[0], port), "regular " + url(ips[1], port), "regular " + url(ips[2], port)}
	c.expect("discovered beside", all...)
	if got := c.disc.Owned(); !slices.Equal(got, []string{url(ips[1], port)}) {
		t.Errorf("discovery owns %v, want only pod b's URL", got)
	}
	if got := c.counter("smg_discovery_registrations_total", "result", "duplicate"); got != 1 {
		t.Errorf("duplicate registrations %v, want 1", got)
	}
	c.delete("a")
	c.stays("the admin's worker outlives the pod with its URL", all...)
	c.delete("b")
	c.expect("discovered one gone", "regular "+url(ips[0], port), "regular "+url(ips[2], port))

	// A discovered worker deleted through the admin API stays deleted
	// until its pod changes.
	c.create(podSpec{name: "b", ip: ips[1], labels: app, ready: true})
	c.expect("b back", all...)
	req, _ := http.NewRequest("DELETE", c.base+"/workers/"+strings.ReplaceAll(url(ips[1], port), "/", "%2F"), nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	c.stays("deleted through the API", "regular "+url(ips[0], port), "regular "+url(ips[2], port))
	c.update(podSpec{name: "b", ip: ips[1], labels: app, ready: false})
	c.update(podSpec{name: "b", ip: ips[1], labels: app, ready: true})
	c.expect("the pod went unready and ready again", all...)
}

// A pod that is Ready before its engine answers /health is registered once
// the engine does; one that never does is retried at the next resync.
func TestHealthGatingAndRetry(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.2:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	c := newCluster(t, k8sdiscovery.Config{Selector: app, Port: port, Resync: time.Second}, func(rc *router.Config) {
		rc.Manager.StartupTimeout = 300 * time.Millisecond
		rc.Manager.StartupInterval = 50 * time.Millisecond
	})
	c.create(podSpec{name: "a", ip: "127.0.0.2", labels: app, ready: true})
	// No engine: the registration times out, the router lists nothing.
	deadline := time.Now().Add(4 * time.Second)
	for c.counter("smg_discovery_registrations_total", "result", "success") < 2 {
		if time.Now().After(deadline) {
			t.Fatal("the failed registration was not retried at resync")
		}
		time.Sleep(20 * time.Millisecond)
	}
	c.expect("engine down")
	s, err := mockworker.Start(mockworker.Config{Host: "127.0.0.2", Port: port})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	deadline = time.Now().Add(3 * time.Second)
	for !slices.Equal(c.workers(), []string{"regular " + url("127.0.0.2", port)}) {
		if time.Now().After(deadline) {
			t.Fatalf("engine up, still %v", c.workers())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Requests keep succeeding while pods come, go unready and are deleted, as
// long as one engine is in the registry.
func TestRequestsSucceedWhilePodsChurn(t *testing.T) {
	port, ips := engines(t, mockworker.RolePrefill, mockworker.RolePrefill, mockworker.RoleDecode, mockworker.RoleDecode, mockworker.RoleDecode)
	prefill := map[string]string{"app": "sglang", "component": "prefill"}
	decode := map[string]string{"app": "sglang", "component": "decode"}
	c := newCluster(t, k8sdiscovery.Config{PD: true, PrefillSelector: prefill, DecodeSelector: decode, Port: port}, nil)
	c.create(podSpec{name: "p-stable", ip: ips[0], labels: prefill, annotations: map[string]string{k8sdiscovery.BootstrapPortAnnotation: "8998"}, ready: true})
	c.create(podSpec{name: "d-stable", ip: ips[2], labels: decode, ready: true})
	c.expect("stable pods", "prefill "+url(ips[0], port)+" bootstrap=8998", "decode "+url(ips[2], port))

	ctx, cancel := context.WithCancel(context.Background())
	var ok, failed atomic.Int64
	var clients sync.WaitGroup
	client := &http.Client{Timeout: 10 * time.Second}
	for range 4 {
		clients.Go(func() {
			for ctx.Err() == nil {
				resp, err := client.Post(c.base+"/generate", "application/json", strings.NewReader(`{"text":"hello","sampling_params":{"max_new_tokens":4}}`))
				if err != nil {
					failed.Add(1)
					continue
				}
				b, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				if resp.StatusCode == 200 {
					ok.Add(1)
				} else {
					failed.Add(1)
					t.Logf("status %d: %s", resp.StatusCode, b)
				}
			}
		})
	}
	churn := []podSpec{
		{name: "p-churn", ip: ips[1], labels: prefill},
		{name: "d-churn-1", ip: ips[3], labels: decode},
		{name: "d-churn-2", ip: ips[4], labels: decode},
	}
	for round := range 6 {
		for _, p := range churn {
			switch round % 3 {
			case 0:
				p.ready = true
				c.create(p)
			case 1:
				c.update(p) // unready
			case 2:
				c.delete(p.name)
			}
		}
		time.Sleep(150 * time.Millisecond)
	}
	cancel()
	clients.Wait()
	client.CloseIdleConnections()
	if failed.Load() != 0 || ok.Load() < 20 {
		t.Fatalf("during churn: %d ok, %d failed", ok.Load(), failed.Load())
	}
	c.expect("after churn", "prefill "+url(ips[0], port)+" bootstrap=8998", "decode "+url(ips[2], port))
}

func TestConfig(t *testing.T) {
	for _, tc := range []struct {
		cfg  k8sdiscovery.Config
		want string
	}{
		{k8sdiscovery.Config{Port: 80}, "needs --selector"},
		{k8sdiscovery.Config{PD: true, Port: 80, Selector: app}, "needs --prefill-selector"},
		{k8sdiscovery.Config{Selector: app, Port: 0}, "--service-discovery-port 0"},
		{k8sdiscovery.Config{Selector: app, Port: 70000}, "--service-discovery-port 70000"},
		{k8sdiscovery.Config{Selector: map[string]string{"app": "has space"}, Port: 80}, "--selector"},
		{k8sdiscovery.Config{PD: true, DecodeSelector: map[string]string{"bad key!": "x"}, Port: 80}, "--decode-selector"},
		{k8sdiscovery.Config{PD: true, DecodeSelector: app, Port: 8000}, ""},
	} {
		err := tc.cfg.Validate()
		if (err == nil) != (tc.want == "") || (err != nil && !strings.Contains(err.Error(), tc.want)) {
			t.Errorf("%+v: %v, want %q", tc.cfg, err, tc.want)
		}
	}
	for _, tc := range []struct {
		in   []string
		want map[string]string
		err  bool
	}{
		{[]string{"app=sglang", "component=prefill"}, map[string]string{"app": "sglang", "component": "prefill"}, false},
		{[]string{"app=sglang component=prefill"}, map[string]string{"app": "sglang", "component": "prefill"}, false}, // YAML list quirk
		{[]string{"k=a=b"}, map[string]string{"k": "a=b"}, false},
		{[]string{"k="}, map[string]string{"k": ""}, false},
		{[]string{"app"}, nil, true},
		{[]string{"=v"}, nil, true},
		{nil, map[string]string{}, false},
	} {
		got, err := k8sdiscovery.ParseSelector(tc.in)
		if (err != nil) != tc.err || (!tc.err && !maps.Equal(got, tc.want)) {
			t.Errorf("ParseSelector(%q) = %v, %v; want %v (error %v)", tc.in, got, err, tc.want, tc.err)
		}
	}
}

// The API server is asked only for pods carrying the labels both PD
// selectors share; local filtering does the rest.
func TestServerSideSelector(t *testing.T) {
	for _, tc := range []struct {
		cfg  k8sdiscovery.Config
		want string
	}{
		{k8sdiscovery.Config{Selector: map[string]string{"app": "x", "tier": "gpu"}, Port: 80}, "app=x,tier=gpu"},
		{k8sdiscovery.Config{PD: true, PrefillSelector: map[string]string{"app": "s", "c": "p"},
			DecodeSelector: map[string]string{"app": "s", "c": "d"}, Port: 80}, "app=s"},
		{k8sdiscovery.Config{PD: true, PrefillSelector: map[string]string{"a": "1"}, DecodeSelector: map[string]string{"b": "2"}, Port: 80}, ""},
		{k8sdiscovery.Config{PD: true, DecodeSelector: map[string]string{"app": "s", "c": "d"}, Port: 80}, "app=s,c=d"},
	} {
		cs := fake.NewClientset()
		var mu sync.Mutex
		var seen []string
		cs.PrependReactor("list", "pods", func(a k8stesting.Action) (bool, runtime.Object, error) {
			mu.Lock()
			seen = append(seen, a.(k8stesting.ListAction).GetListRestrictions().Labels.String())
			mu.Unlock()
			return false, nil, nil
		})
		d, err := k8sdiscovery.New(tc.cfg, noWatchList{cs.CoreV1().Pods("")}, nopRegistrar{}, nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { defer close(done); d.Run(ctx) }()
		for !d.HasSynced() {
			time.Sleep(5 * time.Millisecond)
		}
		cancel()
		<-done
		mu.Lock()
		if len(seen) == 0 || seen[0] != tc.want {
			t.Errorf("%+v: listed with selector %q, want %q", tc.cfg, seen, tc.want)
		}
		mu.Unlock()
	}
}

type nopRegistrar struct{}

func (nopRegistrar) Add(spec balancer.WorkerSpec) (string, error) {
	return "", fmt.Errorf("unexpected add %s", spec.URL)
}
func (nopRegistrar) Remove(string) (balancer.WorkerInfo, bool) { return balancer.WorkerInfo{}, false }
func (nopRegistrar) Get(string) (balancer.WorkerInfo, bool)    { return balancer.WorkerInfo{}, false }
