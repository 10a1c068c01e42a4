package main

import (
	"encoding/json"
	"fmt"
	"maps"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"
	"sigs.k8s.io/yaml"

	"github.com/pdrouter/pdrouter/mock/mockworker"
	"github.com/pdrouter/pdrouter/testkit/testenv"
)

func TestDiscoveryFlags(t *testing.T) {
	o := parse(t, "--pd-disaggregation", "--service-discovery", "--prefill-selector", "app=sglang", "component=prefill",
		"--decode-selector", "app=sglang component=decode", "--service-discovery-port", "30000", "--service-discovery-namespace", "llm")
	cfg, err := o.config()
	if err != nil {
		t.Fatal(err)
	}
	if err := o.discovery.apply(&cfg, zap.NewNop()); err != nil {
		t.Fatal(err)
	}
	d := o.discovery.config
	if !d.PD || d.Port != 30000 || d.Namespace != "llm" ||
		!maps.Equal(d.PrefillSelector, map[string]string{"app": "sglang", "component": "prefill"}) ||
		!maps.Equal(d.DecodeSelector, map[string]string{"app": "sglang", "component": "decode"}) {
		t.Errorf("discovery config %+v", d)
	}
	if p, _ := newParser(); len(p.Ignored()) != 0 {
		t.Errorf("ignored flags %v", p.Ignored())
	}

	// Like sglang-router's launcher, --worker-urls goes under discovery.
	o = parse(t, "--service-discovery", "--selector", "app=x", "--worker-urls", "http://a:1")
	cfg, _ = o.config()
	if err := o.discovery.apply(&cfg, zap.NewNop()); err != nil || len(cfg.WorkerURLs) != 0 || o.discovery.config.Port != 80 {
		t.Errorf("worker urls %v, port %d, err %v", cfg.WorkerURLs, o.discovery.config.Port, err)
	}

	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--service-discovery"}, "needs --selector"},
		{[]string{"--service-discovery", "--pd-disaggregation", "--selector", "a=b"}, "needs --prefill-selector"},
		{[]string{"--service-discovery", "--selector", "app"}, `--selector: selector "app": want key=value`},
		{[]string{"--service-discovery", "--selector", "a=b", "--service-discovery-port", "0"}, "--service-discovery-port 0"},
	} {
		o := parse(t, tc.args...)
		cfg, _ := o.config()
		if err := o.discovery.apply(&cfg, zap.NewNop()); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v: %v, want %q", tc.args, err, tc.want)
		}
	}
	// Without --service-discovery the selectors are parsed by nobody.
	o = parse(t, "--selector", "junk")
	cfg, _ = o.config()
	if err := o.discovery.apply(&cfg, zap.NewNop()); err != nil {
		t.Errorf("discovery off: %v", err)
	}
}

// The router arguments the Helm chart renders are ones pdrouter accepts.
func TestRenderedManifestArgsParse(t *testing.T) {
	for _, file := range []string{"pdrouter.yaml", "sglang-pd.yaml"} {
		b, err := os.ReadFile(filepath.Join("..", "..", "deploy", "manifests", file))
		if err != nil {
			t.Fatal(err)
		}
		var args []string
		for _, doc := range strings.Split(string(b), "\n---\n") {
			var obj struct {
				Kind string
				Spec struct {
					Template struct {
						Spec struct {
							Containers []struct {
								Name string
								Args []string
							}
						}
					}
				}
			}
			if err := yaml.Unmarshal([]byte(doc), &obj); err != nil {
				t.Fatalf("%s: %v", file, err)
			}
			for _, c := range obj.Spec.Template.Spec.Containers {
				if obj.Kind == "Deployment" && c.Name == "pdrouter" {
					args = c.Args
				}
			}
		}
		if args == nil {
			t.Fatalf("%s: no pdrouter container", file)
		}
		p, o := newParser()
		if err := p.Parse(args); err != nil {
			t.Fatalf("%s: %v: %v", file, args, err)
		}
		cfg, err := o.config()
		if err == nil {
			err = o.discovery.apply(&cfg, zap.NewNop())
		}
		if err != nil || !o.discovery.enabled || !cfg.PDDisaggregation || o.discovery.config.Namespace != "llm" {
			t.Errorf("%s: %v (discovery %+v)", file, err, o.discovery.config)
		}
	}
}

// fakeAPIServer serves the pods of namespace "llm" the way kube-apiserver
// does: a list, then a watch stream of the events sent on its channel.
type fakeAPIServer struct {
	*httptest.Server
	mu      sync.Mutex
	pods    []map[string]any
	events  chan map[string]any
	watches int
}

func newFakeAPIServer(t *testing.T, pods ...map[string]any) *fakeAPIServer {
	f := &fakeAPIServer{pods: pods, events: make(chan map[string]any, 16)}
	f.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/api/v1/namespaces/llm/pods" {
			http.Error(w, `{"kind":"Status","apiVersion":"v1","status":"Failure","code":404}`, 404)
			return
		}
		q := r.URL.Query()
		w.Header().Set("Content-Type", "application/json")
		switch {
		case q.Get("sendInitialEvents") == "true": // streaming lists: this server has none, so clients list
			w.WriteHeader(400)
			fmt.Fprint(w, `{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"BadRequest","code":400}`)
		case q.Get("watch") == "true" || q.Get("watch") == "1":
			f.mu.Lock()
			f.watches++
			f.mu.Unlock()
			w.WriteHeader(200)
			w.(http.Flusher).Flush()
			enc := json.NewEncoder(w)
			for {
				select {
				case ev := <-f.events:
					enc.Encode(ev) //nolint:errcheck // a closed client ends the loop below
					w.(http.Flusher).Flush()
				case <-r.Context().Done():
					return
				}
			}
		default:
			f.mu.Lock()
			items := f.pods
			f.mu.Unlock()
			json.NewEncoder(w).Encode(map[string]any{"kind": "PodList", "apiVersion": "v1", //nolint:errcheck // test server
				"metadata": map[string]any{"resourceVersion": "10"}, "items": items})
		}
	}))
	t.Cleanup(f.Close)
	return f
}

func apiPod(name, ip, rv string, ready bool, labels map[string]string) map[string]any {
	status := "False"
	if ready {
		status = "True"
	}
	return map[string]any{"kind": "Pod", "apiVersion": "v1",
		"metadata": map[string]any{"name": name, "namespace": "llm", "resourceVersion": rv, "labels": labels},
		"status": map[string]any{"phase": "Running", "podIP": ip,
			"conditions": []map[string]any{{"type": "Ready", "status": status}}}}
}

// pdrouter --service-discovery against an API server reached through a
// kubeconfig: pods become workers, unready ones leave.
func TestDiscoveryBinaryAgainstAPIServer(t *testing.T) {
	if testing.Short() {
		t.Skip("end-to-end: skipped with -short")
	}
	ln, err := net.Listen("tcp", "127.0.0.2:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	var engines []string
	for _, ip := range []string{"127.0.0.2", "127.0.0.3"} {
		s, err := mockworker.Start(mockworker.Config{Host: ip, Port: port})
		if err != nil {
			t.Skipf("loopback %s:%d: %v", ip, port, err)
		}
		t.Cleanup(func() { s.Close() })
		engines = append(engines, "http://"+ip+":"+strconv.Itoa(port))
	}
	app := map[string]string{"app": "engine"}
	api := newFakeAPIServer(t, apiPod("a", "127.0.0.2", "5", true, app), apiPod("other", "127.0.0.3", "6", true, map[string]string{"app": "x"}))
	kubeconfig := filepath.Join(t.TempDir(), "kubeconfig")
	cfg := fmt.Sprintf("apiVersion: v1\nkind: Config\nclusters: [{name: c, cluster: {server: %q}}]\n"+
		"users: [{name: u, user: {token: t}}]\ncontexts: [{name: x, context: {cluster: c, user: u}}]\ncurrent-context: x\n", api.URL)
	if err := os.WriteFile(kubeconfig, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	rport := testenv.FreePort(t)
	testenv.StartWith(t, testenv.Binary(t, "pdrouter"), testenv.Options{Env: []string{"KUBECONFIG=" + kubeconfig}},
		"--host", "127.0.0.1", "--port", strconv.Itoa(rport), "--prometheus-port", strconv.Itoa(testenv.FreePort(t)),
		"--service-discovery", "--selector", "app=engine", "--service-discovery-port", strconv.Itoa(port),
		"--service-discovery-namespace", "llm", "--policy", "round_robin")
	base := "http://127.0.0.1:" + strconv.Itoa(rport)
	expect := func(what string, want ...string) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second) // includes the router's start
		var got []string
		for time.Now().Before(deadline) {
			got = nil
			if resp, err := http.Get(base + "/workers"); err == nil {
				var body struct{ Workers []struct{ URL string } }
				json.NewDecoder(resp.Body).Decode(&body) //nolint:errcheck // compared below
				resp.Body.Close()
				for _, w := range body.Workers {
					got = append(got, w.URL)
				}
				slices.Sort(got)
				if slices.Equal(got, want) {
					return
				}
			}
			time.Sleep(50 * time.Millisecond)
		}
		t.Fatalf("%s: workers %v, want %v", what, got, want)
	}
	expect("listed", engines[0])
	if resp, err := http.Post(base+"/generate", "application/json", strings.NewReader(`{"text":"hi"}`)); err != nil || resp.StatusCode != 200 {
		t.Fatalf("generate through a discovered worker: %v %v", err, resp)
	} else {
		resp.Body.Close()
	}
	api.events <- map[string]any{"type": "MODIFIED", "object": apiPod("other", "127.0.0.3", "11", true, app)}
	expect("relabelled into the selector", engines...)
	api.events <- map[string]any{"type": "MODIFIED", "object": apiPod("a", "127.0.0.2", "12", false, app)}
	expect("unready", engines[1])
	api.events <- map[string]any{"type": "DELETED", "object": apiPod("other", "127.0.0.3", "13", true, app)}
	expect("deleted")
}
