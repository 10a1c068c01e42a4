package k8sdiscovery

import (
	"fmt"
	"maps"
	"net"
	"slices"
	"strconv"
	"strings"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/labels"

	"github.com/pdrouter/pdrouter/balancer"
)

// BootstrapPortAnnotation carries a prefill pod's
// --disaggregation-bootstrap-port, as in sglang-router.
const BootstrapPortAnnotation = "sglang.ai/bootstrap-port"

// Worker types, as POST /workers spells them.
const (
	roleRegular = "regular"
	rolePrefill = "prefill"
	roleDecode  = "decode"
)

// ParseSelector reads launch_router's `--selector k=v ...` tokens. Like
// sglang-router, a single token holding spaces is split on them; unlike it,
// a token without '=' is an error instead of being dropped, since dropping
// it widens the selector.
func ParseSelector(tokens []string) (map[string]string, error) {
	if len(tokens) == 1 && strings.Contains(tokens[0], " ") {
		tokens = strings.Fields(tokens[0])
	}
	sel := map[string]string{}
	for _, tok := range tokens {
		k, v, ok := strings.Cut(tok, "=")
		if !ok || k == "" {
			return nil, fmt.Errorf("selector %q: want key=value", tok)
		}
		sel[k] = v
	}
	return sel, nil
}

// member is what a qualifying pod contributes to the registry. Equal
// members need no re-registration.
type member struct {
	pod           string // namespace/name
	url           string
	role          string
	bootstrapPort int    // balancer.NoBootstrapPort when absent or invalid
	badPort       string // an annotation that did not parse, for the log
}

func (m member) spec() balancer.WorkerSpec {
	ns, name, _ := strings.Cut(m.pod, "/")
	return balancer.WorkerSpec{URL: m.url, WorkerType: m.role, BootstrapPort: m.bootstrapPort,
		Labels: map[string]string{"k8s_namespace": ns, "k8s_pod": name}}
}

func matches(sel map[string]string, podLabels map[string]string) bool {
	if len(sel) == 0 {
		return false // as in sglang-router: an empty selector selects nothing
	}
	for k, v := range sel {
		if got, ok := podLabels[k]; !ok || got != v {
			return false
		}
	}
	return true
}

// role is the pod's worker type, "" when no selector matches. A pod matching
// both PD selectors is a prefill, as in sglang-router.
func (c *Config) role(pod *corev1.Pod) string {
	switch {
	case !c.PD:
		if matches(c.Selector, pod.Labels) {
			return roleRegular
		}
	case matches(c.PrefillSelector, pod.Labels):
		return rolePrefill
	case matches(c.DecodeSelector, pod.Labels):
		return roleDecode
	}
	return ""
}

// memberOf says whether pod belongs in the registry: selected, Running,
// Ready, with an IP and not being deleted.
func (c *Config) memberOf(key string, pod *corev1.Pod) (member, bool) {
	role := c.role(pod)
	if role == "" || pod.DeletionTimestamp != nil || pod.Status.Phase != corev1.PodRunning || pod.Status.PodIP == "" || !ready(pod) {
		return member{}, false
	}
	m := member{pod: key, role: role, bootstrapPort: balancer.NoBootstrapPort,
		url: "http://" + net.JoinHostPort(pod.Status.PodIP, strconv.Itoa(c.Port))}
	if v, ok := pod.Annotations[c.annotation()]; ok && role == rolePrefill {
		if p, err := strconv.ParseUint(v, 10, 16); err == nil && p > 0 {
			m.bootstrapPort = int(p)
		} else {
			m.badPort = v
		}
	}
	return m, true
}

func ready(pod *corev1.Pod) bool {
	for _, c := range pod.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// serverSelector is the label selector sent to the API server: the
// key=value pairs every configured selector shares, a superset of the pods
// wanted, so the watch does not carry every pod of the namespace (sglang-
// router watches them all and filters locally). Local filtering still
// decides.
func (c *Config) serverSelector() labels.Selector {
	if !c.PD {
		return labels.SelectorFromSet(c.Selector)
	}
	var sels []map[string]string
	for _, s := range []map[string]string{c.PrefillSelector, c.DecodeSelector} {
		if len(s) > 0 {
			sels = append(sels, s)
		}
	}
	if len(sels) == 0 {
		return labels.Nothing()
	}
	common := maps.Clone(sels[0])
	for _, s := range sels[1:] {
		for k, v := range common {
			if s[k] != v {
				delete(common, k)
			}
		}
	}
	return labels.SelectorFromSet(common)
}

// describe renders a selector for logs in a stable order.
func describe(sel map[string]string) string {
	keys := slices.Sorted(maps.Keys(sel))
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = k + "=" + sel[k]
	}
	return strings.Join(parts, ",")
}
