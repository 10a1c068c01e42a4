// Package k8sdiscovery is sglang-router's --service-discovery: it watches
// pods with a client-go informer and keeps the router's workers in step with
// the Running and Ready pods that match the selectors (spec §5.7).
//
// Pods join through the same Registrar call POST /workers makes, so they are
// health-gated the same way, and leave through the one DELETE makes, so
// requests already routed to them finish.
package k8sdiscovery

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/tools/cache"

	"github.com/pdrouter/pdrouter/balancer"
)

// Config is --service-discovery and its companions.
type Config struct {
	PD              bool              // --pd-disaggregation: roles come from the two selectors
	Selector        map[string]string // --selector (regular mode)
	PrefillSelector map[string]string // --prefill-selector
	DecodeSelector  map[string]string // --decode-selector
	Port            int               // --service-discovery-port, the engines' HTTP port
	Namespace       string            // --service-discovery-namespace; "" = all namespaces
	// BootstrapAnnotation names the prefill bootstrap-port annotation;
	// "" = sglang.ai/bootstrap-port.
	BootstrapAnnotation string
	// Resync re-examines every pod this often, retrying registrations that
	// failed (an engine slower than --worker-startup-timeout-secs); 0 = 60 s,
	// sglang-router's discovery interval.
	Resync time.Duration
}

// Validate rejects a configuration that could discover nothing.
func (c *Config) Validate() error {
	if c.Port < 1 || c.Port > 65535 {
		return fmt.Errorf("--service-discovery-port %d: want 1-65535", c.Port)
	}
	if c.PD && len(c.PrefillSelector) == 0 && len(c.DecodeSelector) == 0 {
		return errors.New("--service-discovery in PD mode needs --prefill-selector and/or --decode-selector")
	}
	if !c.PD && len(c.Selector) == 0 {
		return errors.New("--service-discovery needs --selector (or --pd-disaggregation with --prefill-selector/--decode-selector)")
	}
	for flag, sel := range map[string]map[string]string{"--selector": c.Selector,
		"--prefill-selector": c.PrefillSelector, "--decode-selector": c.DecodeSelector} {
		if _, err := labels.ValidatedSelectorFromSet(sel); err != nil {
			return fmt.Errorf("%s: %w", flag, err)
		}
	}
	return nil
}

func (c *Config) annotation() string {
	if c.BootstrapAnnotation == "" {
		return BootstrapPortAnnotation
	}
	return c.BootstrapAnnotation
}

// Registrar is the worker API discovery drives; *balancer.Manager is one.
type Registrar interface {
	Add(balancer.WorkerSpec) (string, error)
	Remove(idOrURL string) (balancer.WorkerInfo, bool)
	Get(idOrURL string) (balancer.WorkerInfo, bool)
}

// Pods lists and watches the pods of one namespace (all when ""); client-go's
// typed PodInterface, real or fake, is one.
type Pods interface {
	List(ctx context.Context, opts metav1.ListOptions) (*corev1.PodList, error)
	Watch(ctx context.Context, opts metav1.ListOptions) (watch.Interface, error)
}

// Discovery keeps a Registrar in step with the pods. Create it with New and
// call Run once.
type Discovery struct {
	cfg      Config
	reg      Registrar
	log      *zap.Logger
	metrics  *Metrics
	informer cache.SharedIndexInformer

	// Touched by the informer's handler goroutine and Sync.
	mu     sync.Mutex
	pods   map[string]member // qualifying pods by namespace/name
	claims map[string]claim  // by URL: what discovery registered
}

// claim is a URL discovery has registered, or found already registered by
// someone else (the admin API, the command line), which it then leaves alone.
type claim struct {
	member
	id    string
	owned bool
}

// New builds the informer; nothing runs until Run. pods may also implement
// client-go's IsWatchListSemanticsUnSupported (the fake clientset's pods
// must, to turn streaming lists off). metrics may be nil.
func New(cfg Config, pods Pods, reg Registrar, log *zap.Logger, metrics *Metrics) (*Discovery, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Resync <= 0 {
		cfg.Resync = 60 * time.Second
	}
	if log == nil {
		log = zap.NewNop()
	}
	d := &Discovery{cfg: cfg, reg: reg, log: log, metrics: metrics, pods: map[string]member{}, claims: map[string]claim{}}
	sel := cfg.serverSelector().String()
	lw := &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			o.LabelSelector = sel
			return pods.List(ctx, o)
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			o.LabelSelector = sel
			return pods.Watch(ctx, o)
		},
	}
	d.informer = cache.NewSharedIndexInformerWithOptions(cache.ToListWatcherWithWatchListSemantics(lw, pods), &corev1.Pod{},
		cache.SharedIndexInformerOptions{ResyncPeriod: cfg.Resync})
	if err := d.informer.SetTransform(slim); err != nil {
		return nil, err
	}
	if err := d.informer.SetWatchErrorHandlerWithContext(func(_ context.Context, _ *cache.Reflector, err error) {
		d.log.Warn("service discovery: pod watch failed; listing again after a backoff", zap.Error(err))
	}); err != nil {
		return nil, err
	}
	_, err := d.informer.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { d.observe(obj, false) },
		UpdateFunc: func(_, obj any) { d.observe(obj, false) },
		DeleteFunc: func(obj any) { d.observe(obj, true) },
	})
	if err != nil {
		return nil, err
	}
	if cfg.PD {
		log.Info("service discovery: watching pods", zap.String("namespace", cfg.Namespace), zap.Bool("pd", true),
			zap.String("prefill", describe(cfg.PrefillSelector)), zap.String("decode", describe(cfg.DecodeSelector)))
	} else {
		log.Info("service discovery: watching pods", zap.String("namespace", cfg.Namespace), zap.String("selector", describe(cfg.Selector)))
	}
	return d, nil
}

// slim keeps only what discovery reads, so watching a busy namespace costs
// little memory.
func slim(obj any) (any, error) {
	pod, ok := obj.(*corev1.Pod)
	if !ok {
		return obj, nil // a DeletedFinalStateUnknown tombstone
	}
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: pod.Name, Namespace: pod.Namespace, UID: pod.UID, ResourceVersion: pod.ResourceVersion,
			Labels: pod.Labels, Annotations: pod.Annotations, DeletionTimestamp: pod.DeletionTimestamp},
		Status: corev1.PodStatus{Phase: pod.Status.Phase, PodIP: pod.Status.PodIP, Conditions: pod.Status.Conditions},
	}, nil
}

// Run watches until ctx ends. Workers it registered stay registered: the
// router is stopping with it.
func (d *Discovery) Run(ctx context.Context) {
	d.informer.RunWithContext(ctx)
}

// HasSynced reports whether the first list has been applied.
func (d *Discovery) HasSynced() bool { return d.informer.HasSynced() }

// observe applies one informer event. A Delete carries the last state seen,
// or a tombstone when the deletion happened while the watch was down and
// a later list no longer had the pod.
func (d *Discovery) observe(obj any, deleted bool) {
	if t, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj, deleted = t.Obj, true
	}
	pod, ok := obj.(*corev1.Pod)
	if !ok {
		return
	}
	key := pod.Namespace + "/" + pod.Name
	var next member
	qualifies := false
	if !deleted {
		next, qualifies = d.cfg.memberOf(key, pod)
	}
	reason := ReasonReconciled
	if deleted || pod.DeletionTimestamp != nil {
		reason = ReasonPodDeleted
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	prev, had := d.pods[key]
	if qualifies {
		d.pods[key] = next
	} else {
		delete(d.pods, key)
	}
	d.metrics.discovered(len(d.pods))
	if had && prev.url != next.url {
		d.sync(prev.url, reason)
	}
	if qualifies {
		d.sync(next.url, reason)
	}
}

// wanted is the member that should hold url: of the pods sharing it (an IP
// reused before the old pod's deletion was seen), the first by name.
func (d *Discovery) wanted(url string) (member, bool) {
	var best member
	found := false
	for key, m := range d.pods {
		if m.url == url && (!found || key < best.pod) {
			best, found = m, true
		}
	}
	return best, found
}

// sync makes the registry agree with the pods for url; caller holds mu.
func (d *Discovery) sync(url, reason string) {
	want, wanted := d.wanted(url)
	have, had := d.claims[url]
	if had && (!wanted || have.member != want) {
		delete(d.claims, url)
		had = false
		if have.owned {
			if _, ok := d.reg.Remove(have.id); ok {
				d.metrics.deregistered(reason)
				d.log.Info("service discovery: worker left", zap.String("url", url), zap.String("pod", have.pod), zap.String("reason", reason))
			}
		}
	}
	switch {
	case !wanted:
	case !had:
		d.register(want)
	case have.owned:
		// A registration that failed (health gating timed out) is tried
		// again. One removed through DELETE /workers stays removed until
		// the pod changes.
		if wi, ok := d.reg.Get(have.id); ok && wi.JobStatus != nil && wi.JobStatus.Status == balancer.JobFailed {
			delete(d.claims, url)
			d.register(want)
		}
	default:
		// Someone else's worker at this URL: claim the URL once it is gone.
		if _, ok := d.reg.Get(url); !ok {
			delete(d.claims, url)
			d.register(want)
		}
	}
}

func (d *Discovery) register(m member) {
	if m.badPort != "" {
		d.log.Warn("service discovery: bootstrap-port annotation is not a port; registering with none",
			zap.String("pod", m.pod), zap.String("annotation", d.cfg.annotation()), zap.String("value", m.badPort))
	}
	id, err := d.reg.Add(m.spec())
	switch {
	case errors.Is(err, balancer.ErrWorkerExists):
		d.claims[m.url] = claim{member: m, id: id}
		d.metrics.registered(ResultDuplicate)
		d.log.Info("service discovery: pod's URL is already a worker; leaving that one in place", zap.String("url", m.url), zap.String("pod", m.pod))
	case err != nil:
		d.metrics.registered(ResultFailed)
		d.log.Warn("service discovery: worker not registered", zap.String("url", m.url), zap.String("pod", m.pod), zap.Error(err))
	default:
		d.claims[m.url] = claim{member: m, id: id, owned: true}
		d.metrics.registered(ResultSuccess)
		d.log.Info("service discovery: worker joining", zap.String("url", m.url), zap.String("pod", m.pod),
			zap.String("type", m.role), zap.Int("bootstrap_port", max(m.bootstrapPort, 0)))
	}
}

// Owned lists the URLs discovery registered itself, sorted (tests, debugging).
func (d *Discovery) Owned() []string {
	d.mu.Lock()
	defer d.mu.Unlock()
	var out []string
	for url, c := range d.claims {
		if c.owned {
			out = append(out, url)
		}
	}
	slices.Sort(out)
	return out
}
