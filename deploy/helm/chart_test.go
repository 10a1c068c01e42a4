// Package helm tests the chart in pdrouter/: it renders with Helm's own
// engine (the SDK, not a helm binary) and every object decodes strictly into
// client-go's types. It is a module of its own so that the Helm SDK is no
// dependency of pdrouter's.
//
// go test ./... -update rewrites deploy/manifests from the chart.
package helm

import (
	"bytes"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/engine"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer/json"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/kubernetes/scheme"
	"sigs.k8s.io/yaml"
)

var update = flag.Bool("update", false, "rewrite deploy/manifests from the chart")

// render runs `helm template` in process: release "pdrouter" in namespace
// "llm", with the chart's values overlaid by the files named.
func render(t *testing.T, releaseName string, valueFiles ...string) string {
	t.Helper()
	chart, err := loader.Load("pdrouter")
	if err != nil {
		t.Fatal(err)
	}
	vals := map[string]any{}
	for _, f := range valueFiles {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		var v map[string]any
		if err := yaml.Unmarshal(b, &v); err != nil {
			t.Fatalf("%s: %v", f, err)
		}
		vals = chartutil.MergeTables(v, vals)
	}
	if err := chartutil.ProcessDependenciesWithMerge(chart, vals); err != nil {
		t.Fatal(err)
	}
	top, err := chartutil.ToRenderValues(chart, vals, chartutil.ReleaseOptions{Name: releaseName, Namespace: "llm",
		IsInstall: true, Revision: 1}, chartutil.DefaultCapabilities)
	if err != nil {
		t.Fatal(err)
	}
	files, err := engine.Render(chart, top)
	if err != nil {
		t.Fatal(err)
	}
	names := make([]string, 0, len(files))
	for name := range files {
		if strings.HasSuffix(name, ".yaml") {
			names = append(names, name)
		}
	}
	slices.Sort(names)
	var out strings.Builder
	for _, name := range names {
		body := strings.TrimSpace(files[name])
		for _, doc := range splitDocs(body) {
			fmt.Fprintf(&out, "---\n# Source: %s\n%s\n", name, doc)
		}
	}
	return out.String()
}

var docSep = regexp.MustCompile(`(?m)^---\s*$`)

func splitDocs(s string) []string {
	var docs []string
	for _, d := range docSep.Split(s, -1) {
		if d = strings.TrimSpace(d); d != "" && !onlyComments(d) {
			docs = append(docs, d)
		}
	}
	return docs
}

func onlyComments(doc string) bool {
	for _, line := range strings.Split(doc, "\n") {
		if l := strings.TrimSpace(line); l != "" && !strings.HasPrefix(l, "#") {
			return false
		}
	}
	return true
}

// decode reads every object strictly: an unknown or mistyped field of a
// built-in kind fails, as the API server's strict field validation would.
func decode(t *testing.T, manifest string) []runtime.Object {
	t.Helper()
	strict := json.NewSerializerWithOptions(json.DefaultMetaFactory, scheme.Scheme, scheme.Scheme,
		json.SerializerOptions{Yaml: true, Strict: true})
	var objs []runtime.Object
	for _, doc := range splitDocs(manifest) {
		var u unstructured.Unstructured
		j, err := yaml.YAMLToJSON([]byte(doc))
		if err != nil {
			t.Fatalf("not YAML: %v\n%s", err, doc)
		}
		if err := u.UnmarshalJSON(j); err != nil {
			t.Fatalf("not an object: %v\n%s", err, doc)
		}
		if u.GetAPIVersion() == "monitoring.coreos.com/v1" {
			objs = append(objs, &u) // the Prometheus Operator's CRD: checked by hand below
			continue
		}
		obj, _, err := strict.Decode([]byte(doc), nil, nil)
		if err != nil {
			t.Fatalf("%s %s: %v", u.GetKind(), u.GetName(), err)
		}
		objs = append(objs, obj)
	}
	return objs
}

// check applies the API server's rules that a typo in a template breaks:
// names, labels, selectors, and ports that Services and probes refer to.
func check(t *testing.T, objs []runtime.Object) {
	t.Helper()
	dns := func(what, s string) {
		if errs := validation.IsDNS1123Subdomain(s); len(errs) > 0 {
			t.Errorf("%s %q: %v", what, s, errs)
		}
	}
	podPorts := map[string]bool{}
	var pods []labels.Set
	for _, obj := range objs {
		if m, ok := obj.(interface{ GetName() string }); ok {
			dns(fmt.Sprintf("%T name", obj), m.GetName())
		}
		if m, ok := obj.(interface{ GetLabels() map[string]string }); ok {
			for k, v := range m.GetLabels() {
				if errs := append(validation.IsQualifiedName(k), validation.IsValidLabelValue(v)...); len(errs) > 0 {
					t.Errorf("label %s=%s: %v", k, v, errs)
				}
			}
		}
		switch o := obj.(type) {
		case *appsv1.Deployment:
			sel := labels.SelectorFromSet(o.Spec.Selector.MatchLabels)
			if len(o.Spec.Selector.MatchLabels) == 0 || !sel.Matches(labels.Set(o.Spec.Template.Labels)) {
				t.Errorf("deployment %s: selector %v does not match its pods' labels %v", o.Name, o.Spec.Selector.MatchLabels, o.Spec.Template.Labels)
			}
			pods = append(pods, o.Spec.Template.Labels)
			for _, c := range o.Spec.Template.Spec.Containers {
				own := map[string]bool{}
				for _, p := range c.Ports {
					if errs := validation.IsValidPortName(p.Name); len(errs) > 0 {
						t.Errorf("%s/%s port %q: %v", o.Name, c.Name, p.Name, errs)
					}
					if p.ContainerPort < 1 || p.ContainerPort > 65535 {
						t.Errorf("%s/%s port %q: %d", o.Name, c.Name, p.Name, p.ContainerPort)
					}
					own[p.Name], podPorts[p.Name] = true, true
				}
				for _, probe := range []*corev1.Probe{c.LivenessProbe, c.ReadinessProbe, c.StartupProbe} {
					if probe != nil && probe.HTTPGet != nil && probe.HTTPGet.Port.StrVal != "" && !own[probe.HTTPGet.Port.StrVal] {
						t.Errorf("%s/%s: probe on port %q, which the container does not name", o.Name, c.Name, probe.HTTPGet.Port.StrVal)
					}
				}
				mounts := map[string]bool{}
				for _, v := range o.Spec.Template.Spec.Volumes {
					mounts[v.Name] = true
				}
				for _, m := range c.VolumeMounts {
					if !mounts[m.Name] {
						t.Errorf("%s/%s mounts volume %q, which the pod lacks", o.Name, c.Name, m.Name)
					}
				}
			}
		case *rbacv1.Role:
			checkRules(t, o.Name, o.Rules)
		case *rbacv1.ClusterRole:
			checkRules(t, o.Name, o.Rules)
		case *unstructured.Unstructured:
			eps, _, _ := unstructured.NestedSlice(o.Object, "spec", "endpoints")
			sel, _, _ := unstructured.NestedStringMap(o.Object, "spec", "selector", "matchLabels")
			if o.GetKind() != "ServiceMonitor" || len(eps) == 0 || len(sel) == 0 {
				t.Errorf("%s %s: want a ServiceMonitor with a selector and endpoints", o.GetKind(), o.GetName())
			}
		}
	}
	for _, obj := range objs {
		svc, ok := obj.(*corev1.Service)
		if !ok {
			continue
		}
		sel := labels.SelectorFromSet(svc.Spec.Selector)
		if !slices.ContainsFunc(pods, func(l labels.Set) bool { return sel.Matches(l) }) {
			t.Errorf("service %s: selector %v matches no pod template", svc.Name, svc.Spec.Selector)
		}
		for _, p := range svc.Spec.Ports {
			if p.TargetPort.StrVal != "" && !podPorts[p.TargetPort.StrVal] {
				t.Errorf("service %s: target port %q is no container's", svc.Name, p.TargetPort.StrVal)
			}
		}
	}
}

// checkRules holds discovery's RBAC to what it needs: reading pods.
func checkRules(t *testing.T, name string, rules []rbacv1.PolicyRule) {
	t.Helper()
	want := []rbacv1.PolicyRule{{APIGroups: []string{""}, Resources: []string{"pods"}, Verbs: []string{"get", "list", "watch"}}}
	if fmt.Sprint(rules) != fmt.Sprint(want) {
		t.Errorf("%s: rules %v, want only %v", name, rules, want)
	}
}

func kinds(objs []runtime.Object) map[string]int {
	n := map[string]int{}
	for _, o := range objs {
		if u, ok := o.(*unstructured.Unstructured); ok {
			n[u.GetKind()]++
			continue
		}
		gvks, _, _ := scheme.Scheme.ObjectKinds(o)
		n[gvks[0].Kind]++
	}
	return n
}

func routerArgs(t *testing.T, objs []runtime.Object) []string {
	t.Helper()
	for _, o := range objs {
		if d, ok := o.(*appsv1.Deployment); ok && d.Spec.Template.Spec.Containers[0].Name == "pdrouter" {
			return d.Spec.Template.Spec.Containers[0].Args
		}
	}
	t.Fatal("no router Deployment")
	return nil
}

// golden compares a rendering with its committed plain manifest.
func golden(t *testing.T, file, header, got string) {
	t.Helper()
	path := filepath.Join("..", "manifests", file)
	got = header + got
	if *update {
		if err := os.WriteFile(path, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (go test ./... -update writes it)", err)
	}
	if !bytes.Equal(want, []byte(got)) {
		t.Errorf("%s is not what the chart renders: run go test ./... -update in deploy/helm", path)
	}
}

const header = "# Rendered from deploy/helm/pdrouter (release pdrouter, namespace llm) by\n# `go test ./... -update` in deploy/helm. Edit the chart, not this file.\n"

func TestDefaultValues(t *testing.T) {
	out := render(t, "pdrouter")
	objs := decode(t, out)
	check(t, objs)
	want := map[string]int{"Deployment": 1, "Service": 1, "ServiceAccount": 1, "Role": 1, "RoleBinding": 1}
	if got := kinds(objs); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("objects %v, want %v", got, want)
	}
	args := strings.Join(routerArgs(t, objs), " ")
	for _, want := range []string{"--pd-disaggregation", "--service-discovery --service-discovery-port 8000",
		"--service-discovery-namespace llm", "--prefill-selector app=sglang component=prefill",
		"--decode-selector app=sglang component=decode"} {
		if !strings.Contains(args, want) {
			t.Errorf("router args %q lack %q", args, want)
		}
	}
	golden(t, "pdrouter.yaml", header, out)
}

func TestSGLangPDExample(t *testing.T) {
	out := render(t, "pdrouter", "pdrouter/examples/sglang-pd.yaml")
	objs := decode(t, out)
	check(t, objs)
	want := map[string]int{"Deployment": 3, "Service": 1, "ServiceAccount": 1, "Role": 1, "RoleBinding": 1, "ServiceMonitor": 1}
	if got := kinds(objs); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("objects %v, want %v", got, want)
	}
	// The engines carry what the router selects on.
	found := map[string]bool{}
	for _, o := range objs {
		d, ok := o.(*appsv1.Deployment)
		if !ok || d.Spec.Template.Spec.Containers[0].Name != "sglang" {
			continue
		}
		tpl := d.Spec.Template
		role := tpl.Labels["component"]
		found[role] = true
		if tpl.Labels["app"] != "sglang" {
			t.Errorf("%s: labels %v", d.Name, tpl.Labels)
		}
		port, has := tpl.Annotations["sglang.ai/bootstrap-port"]
		if (role == "prefill") != has || (has && port != "8998") {
			t.Errorf("%s: bootstrap annotation %q (present %v)", d.Name, port, has)
		}
		cs := tpl.Spec.Containers
		if len(cs) != 2 || cs[1].Name != "kvproxy" {
			t.Fatalf("%s: containers %d, want sglang and its kvproxy", d.Name, len(cs))
		}
		// Engine and sidecar share the control socket's volume.
		shared := false
		for _, m := range cs[1].VolumeMounts {
			shared = shared || m.MountPath == "/run/kvproxy"
		}
		if !shared || !slices.ContainsFunc(cs[0].Env, func(e corev1.EnvVar) bool {
			return e.Name == "PDROUTER_KVPROXY_SOCK" && e.Value == "/run/kvproxy/kvproxy.sock"
		}) {
			t.Errorf("%s: the engine does not reach kvproxy's socket", d.Name)
		}
		if !slices.Contains(cs[1].Args, role) {
			t.Errorf("%s: kvproxy args %v lack --role %s", d.Name, cs[1].Args, role)
		}
	}
	if !found["prefill"] || !found["decode"] {
		t.Errorf("engine roles %v, want prefill and decode", found)
	}
	golden(t, "sglang-pd.yaml", header, out)
}

func TestClusterWideAndTLS(t *testing.T) {
	dir := t.TempDir()
	vals := filepath.Join(dir, "v.yaml")
	if err := os.WriteFile(vals, []byte("discovery: {namespace: '*'}\nrouter: {pdDisaggregation: false}\ntls: {enabled: true, secretName: router-tls}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	objs := decode(t, render(t, "edge", vals))
	check(t, objs)
	k := kinds(objs)
	if k["ClusterRole"] != 1 || k["ClusterRoleBinding"] != 1 || k["Role"] != 0 {
		t.Errorf("watching all namespaces: objects %v, want a ClusterRole and its binding", k)
	}
	args := strings.Join(routerArgs(t, objs), " ")
	for _, want := range []string{"--selector app=sglang", "--tls-cert-path /etc/pdrouter/tls/tls.crt"} {
		if !strings.Contains(args, want) {
			t.Errorf("router args %q lack %q", args, want)
		}
	}
	if strings.Contains(args, "--service-discovery-namespace") || strings.Contains(args, "--pd-disaggregation") {
		t.Errorf("router args %q", args)
	}
	for _, o := range objs {
		if d, ok := o.(*appsv1.Deployment); ok {
			if p := d.Spec.Template.Spec.Containers[0].ReadinessProbe.HTTPGet; p.Scheme != corev1.URISchemeHTTPS {
				t.Errorf("readiness probe scheme %q under TLS", p.Scheme)
			}
		}
	}
}
