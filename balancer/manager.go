package balancer

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/google/uuid"
	"go.uber.org/zap"
)

// ManagerConfig is what the Manager needs from the CLI.
type ManagerConfig struct {
	PD               bool          // readiness needs a prefill and a decode worker
	StartupTimeout   time.Duration // --worker-startup-timeout-secs, per worker
	StartupInterval  time.Duration // --worker-startup-check-interval: cap of the registration poll interval
	LoadPollInterval time.Duration // > 0 polls /get_load; 0 polls every StartupInterval (spec) once a policy reading loads is attached
	Health           HealthConfig
	Breaker          BreakerConfig
	APIKey           string       // --api-key, for workers registered without their own
	Client           *http.Client // for probes and metadata; nil = a private one
	Metrics          *Metrics     // nil = no metrics
	Logger           *zap.Logger  // nil = no logs
}

// WorkerSpec is a worker to register: a CLI worker or the body of POST /workers.
type WorkerSpec struct {
	URL                string            `json:"url"`
	APIKey             string            `json:"api_key,omitempty"`
	ModelID            string            `json:"model_id,omitempty"`
	Priority           *uint32           `json:"priority,omitempty"`
	Cost               *float32          `json:"cost,omitempty"`
	WorkerType         string            `json:"worker_type,omitempty"`    // regular (default), prefill or decode
	BootstrapPort      int               `json:"bootstrap_port,omitempty"` // prefill only; 0 or NoBootstrapPort = none
	Labels             map[string]string `json:"labels,omitempty"`
	DisableHealthCheck bool              `json:"disable_health_check,omitempty"`
}

// WorkerUpdate is the body of PUT /workers/{id}; nil fields stay unchanged.
type WorkerUpdate struct {
	Priority *uint32           `json:"priority,omitempty"`
	Cost     *float32          `json:"cost,omitempty"`
	Labels   map[string]string `json:"labels,omitempty"`
	APIKey   *string           `json:"api_key,omitempty"`
}

var (
	ErrWorkerExists   = errors.New("worker already registered")
	ErrWorkerNotFound = errors.New("worker not found")
	ErrInvalidWorker  = errors.New("invalid worker")
)

// Manager registers workers in the background the way sglang-router 0.3.x
// does (wait for /health, discover the model, register, activate), keeps
// each registration's job status, and owns the health checker, the load
// monitor and the background work of policies. Every goroutine it starts
// ends in Stop.
type Manager struct {
	cfg      ManagerConfig
	pollLoad bool // an attached policy reads engine loads; set before Start
	reg      *Registry
	client   *http.Client
	log      *zap.Logger

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu   sync.Mutex
	jobs map[string]*job // by worker id: running or failed registrations
}

type job struct {
	w      *Worker
	status *JobStatus // replaced, never mutated, so Info can share it
	cancel context.CancelFunc
	done   chan struct{}
	err    error // set before done closes
}

// DefaultManagerConfig is sglang-router 0.3.x's worker start-up, health
// check and circuit breaker defaults.
func DefaultManagerConfig() ManagerConfig {
	return ManagerConfig{
		StartupTimeout:  1800 * time.Second,
		StartupInterval: 30 * time.Second,
		Health:          DefaultHealthConfig(),
		Breaker:         DefaultBreakerConfig(),
	}
}

// NewManager builds a manager with its own registry; nothing runs until
// Start or Add. Fields that are zero (or not positive) take
// DefaultManagerConfig's values, the breaker as a whole.
func NewManager(cfg ManagerConfig) *Manager {
	def := DefaultManagerConfig()
	h, dh := &cfg.Health, def.Health
	h.Endpoint = cmp.Or(h.Endpoint, dh.Endpoint)
	h.Interval = positiveOr(h.Interval, dh.Interval)
	h.Timeout = positiveOr(h.Timeout, dh.Timeout)
	h.FailureThreshold = positiveOr(h.FailureThreshold, dh.FailureThreshold)
	h.SuccessThreshold = positiveOr(h.SuccessThreshold, dh.SuccessThreshold)
	cfg.StartupTimeout = positiveOr(cfg.StartupTimeout, def.StartupTimeout)
	cfg.StartupInterval = positiveOr(cfg.StartupInterval, def.StartupInterval)
	cfg.Breaker = cmp.Or(cfg.Breaker, def.Breaker)
	m := &Manager{cfg: cfg, reg: NewRegistry(), client: cfg.Client, log: cfg.Logger, jobs: map[string]*job{}}
	if m.client == nil {
		m.client = &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 4, IdleConnTimeout: 90 * time.Second}}
	}
	if m.log == nil {
		m.log = zap.NewNop()
	}
	m.ctx, m.cancel = context.WithCancel(context.Background())
	return m
}

func (m *Manager) Registry() *Registry { return m.reg }
func (m *Manager) Snapshot() *Snapshot { return m.reg.Snapshot() }

// Start launches the health checker (unless disabled), the load monitor
// (when configured) and the per-worker metrics.
func (m *Manager) Start() error {
	if err := m.cfg.Metrics.watch(m.reg); err != nil {
		return fmt.Errorf("balancer metrics: %w", err)
	}
	if !m.cfg.Health.Disabled {
		h := &healthChecker{cfg: m.cfg.Health, reg: m.reg, client: m.client, metrics: m.cfg.Metrics}
		m.wg.Go(func() { h.run(m.ctx) })
	}
	if m.pollLoad || m.cfg.LoadPollInterval > 0 {
		lm := &loadMonitor{reg: m.reg, client: m.client, interval: positiveOr(m.cfg.LoadPollInterval, m.cfg.StartupInterval),
			timeout: m.cfg.Health.Timeout}
		m.wg.Go(func() { lm.run(m.ctx) })
	}
	if d := newOutlierDetector(m.cfg, m.reg, m.client); d != nil {
		m.wg.Go(func() { d.run(m.ctx) })
	}
	return nil
}

// AttachPolicy keeps a policy in step with the registry and runs its
// background work (tree eviction, rebalancing) until Stop. Call it before
// Start: a policy that reads engine loads turns the load poll on.
func (m *Manager) AttachPolicy(p Policy) {
	if info, ok := LookupPolicy(p.Name()); ok && info.ReadsLoad {
		m.pollLoad = true
	}
	if ww, ok := p.(WorkerWatcher); ok {
		m.reg.OnChange(ww.WorkersChanged)
	}
	if r, ok := p.(Runner); ok {
		m.wg.Go(func() { r.Run(m.ctx) })
	}
}

// Stop cancels registrations and background loops and waits for them.
func (m *Manager) Stop() {
	m.cancel()
	m.wg.Wait()
	m.client.CloseIdleConnections()
}

// Add validates spec and registers the worker in the background, returning
// its id at once. The job's progress shows in Get; Await waits for it.
func (m *Manager) Add(spec WorkerSpec) (string, error) {
	w, err := m.newWorker(spec)
	if err != nil {
		return "", err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if old := m.reg.Snapshot().ByURL(w.URL); old != nil {
		return old.ID, fmt.Errorf("%w: %s", ErrWorkerExists, w.URL)
	}
	for id, j := range m.jobs {
		if j.w.URL == w.URL {
			if j.status.Status != JobFailed {
				return id, fmt.Errorf("%w: %s", ErrWorkerExists, w.URL)
			}
			delete(m.jobs, id) // a failed attempt may be retried
		}
	}
	ctx, cancel := context.WithCancel(m.ctx)
	j := &job{w: w, status: newJobStatus(w.URL, JobPending, ""), cancel: cancel, done: make(chan struct{})}
	m.jobs[w.ID] = j
	m.wg.Go(func() { m.register(ctx, j) })
	return w.ID, nil
}

func (m *Manager) newWorker(spec WorkerSpec) (*Worker, error) {
	u, err := url.Parse(spec.URL)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("%w: url %q must be http(s)://host[:port]", ErrInvalidWorker, spec.URL)
	}
	typ, ok := ParseWorkerType(spec.WorkerType)
	if !ok {
		return nil, fmt.Errorf("%w: worker_type %q", ErrInvalidWorker, spec.WorkerType)
	}
	port := spec.BootstrapPort
	if port <= 0 || typ != Prefill {
		port = NoBootstrapPort
	}
	w := NewWorker(spec.URL, typ, port)
	w.ID = uuid.NewString()
	w.Breaker = NewBreaker(m.cfg.Breaker)
	w.APIKey = cmp.Or(spec.APIKey, m.cfg.APIKey)
	w.DisableHealthCheck = spec.DisableHealthCheck
	w.Labels = spec.Labels
	w.ModelID = cmp.Or(spec.ModelID, w.ModelID)
	if spec.Priority != nil {
		w.Priority = *spec.Priority
	}
	if spec.Cost != nil {
		w.Cost = *spec.Cost
	}
	m.cfg.Metrics.instrument(w)
	return w, nil
}

// register is one AddWorker job: wait for health, discover, publish.
func (m *Manager) register(ctx context.Context, j *job) {
	defer j.cancel()
	w := j.w
	m.setStatus(j, JobProcessing, "waiting for "+m.cfg.Health.Endpoint)
	err := m.awaitHealthy(ctx, w)
	var id string
	if err == nil && w.ModelID == "unknown" {
		id = m.discoverModel(ctx, w)
	}
	m.mu.Lock()
	switch {
	case m.jobs[w.ID] != j: // removed (or shutting down) meanwhile: do not publish
		err = cmp.Or(err, ErrWorkerNotFound)
	case err != nil:
		j.status = newJobStatus(w.URL, JobFailed, err.Error())
		m.log.Warn("worker registration failed", zap.String("url", w.URL), zap.Error(err))
	default:
		w.ModelID = cmp.Or(id, w.ModelID) // under mu: Get may be reading the pending worker
		if _, added := m.reg.Add(w); added {
			delete(m.jobs, w.ID)
			m.log.Info("worker registered", zap.String("url", w.URL), zap.String("type", w.Type.String()), zap.String("model", w.ModelID))
		} else {
			err = fmt.Errorf("%w: %s", ErrWorkerExists, w.URL)
			j.status = newJobStatus(w.URL, JobFailed, err.Error())
		}
	}
	j.err = err
	m.mu.Unlock()
	close(j.done)
}

// awaitHealthy polls the health endpoint until 2xx, backing off from 100 ms
// to StartupInterval so a worker that is up a moment late joins quickly.
func (m *Manager) awaitHealthy(ctx context.Context, w *Worker) error {
	ctx, cancel := context.WithTimeout(ctx, m.cfg.StartupTimeout)
	defer cancel()
	wait := 100 * time.Millisecond
	for {
		if probe(ctx, m.client, w, m.cfg.Health.Endpoint, m.cfg.Health.Timeout) {
			return nil
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			if errors.Is(ctx.Err(), context.DeadlineExceeded) {
				return fmt.Errorf("timeout %s waiting for %s to become healthy", m.cfg.StartupTimeout, w.URL)
			}
			return ctx.Err()
		case <-t.C:
		}
		wait = min(wait*2, m.cfg.StartupInterval)
	}
}

// discoverModel reads served_model_name, else model_path, from /server_info
// (falling back to /get_server_info). Failures only leave the id unknown.
func (m *Manager) discoverModel(ctx context.Context, w *Worker) string {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	for _, path := range []string{"/server_info", "/get_server_info"} {
		resp, err := get(ctx, m.client, w.URL+path, w.APIKey)
		if err != nil {
			return ""
		}
		var info struct {
			ServedModelName any    `json:"served_model_name"` // a string, or a list in some SGLang versions
			ModelPath       string `json:"model_path"`
		}
		ok := resp.StatusCode/100 == 2 && json.NewDecoder(io.LimitReader(resp.Body, 1<<20)).Decode(&info) == nil
		resp.Body.Close()
		if !ok {
			continue
		}
		switch n := info.ServedModelName.(type) {
		case string:
			if n != "" {
				return n
			}
		case []any:
			if len(n) > 0 {
				if s, _ := n[0].(string); s != "" {
					return s
				}
			}
		}
		return info.ModelPath
	}
	return ""
}

func (m *Manager) setStatus(j *job, status, msg string) {
	m.mu.Lock()
	j.status = newJobStatus(j.w.URL, status, msg)
	m.mu.Unlock()
}

// Await waits until the registration of id has finished and returns its
// error (nil once registered).
func (m *Manager) Await(ctx context.Context, id string) error {
	m.mu.Lock()
	j := m.jobs[id]
	m.mu.Unlock()
	if j == nil {
		if m.reg.Snapshot().ByID(id) != nil {
			return nil
		}
		return ErrWorkerNotFound
	}
	select {
	case <-j.done:
		return j.err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Get finds a registered worker or a registration job by id or URL.
func (m *Manager) Get(idOrURL string) (WorkerInfo, bool) {
	if w := m.lookup(idOrURL); w != nil {
		return w.Info(), true
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if j := m.job(idOrURL); j != nil {
		wi := j.w.Info()
		wi.IsHealthy = false
		wi.JobStatus = j.status
		return wi, true
	}
	return WorkerInfo{}, false
}

// job finds a job by id or URL; caller holds mu.
func (m *Manager) job(idOrURL string) *job {
	if j := m.jobs[idOrURL]; j != nil {
		return j
	}
	u := strings.TrimRight(idOrURL, "/")
	for _, j := range m.jobs {
		if j.w.URL == u {
			return j
		}
	}
	return nil
}

func (m *Manager) lookup(idOrURL string) *Worker {
	s := m.reg.Snapshot()
	if w := s.ByID(idOrURL); w != nil {
		return w
	}
	return s.ByURL(strings.TrimRight(idOrURL, "/"))
}

// List describes the registered workers (pending registrations are not
// counted: clients wait for the total to reach N).
func (m *Manager) List() []WorkerInfo {
	all := m.reg.Snapshot().All
	out := make([]WorkerInfo, len(all))
	for i, w := range all {
		out[i] = w.Info()
	}
	return out
}

// Remove unregisters a worker (or cancels its registration) by id or URL.
// Requests already routed to it finish normally.
func (m *Manager) Remove(idOrURL string) (WorkerInfo, bool) {
	m.mu.Lock()
	if j := m.job(idOrURL); j != nil {
		delete(m.jobs, j.w.ID)
		m.mu.Unlock()
		j.cancel()
		return j.w.Info(), true
	}
	m.mu.Unlock()
	w := m.lookup(idOrURL)
	if w == nil {
		return WorkerInfo{}, false
	}
	if _, ok := m.reg.Remove(w.URL); !ok {
		return WorkerInfo{}, false
	}
	m.cfg.Metrics.forget(w.URL)
	m.log.Info("worker removed", zap.String("url", w.URL))
	return w.Info(), true
}

// Update changes a registered worker's priority, cost, labels or API key.
func (m *Manager) Update(idOrURL string, u WorkerUpdate) (WorkerInfo, error) {
	w := m.lookup(idOrURL)
	if w == nil {
		return WorkerInfo{}, ErrWorkerNotFound
	}
	nw := w.withAttrs(u)
	if !m.reg.replace(nw) {
		return WorkerInfo{}, ErrWorkerNotFound
	}
	return nw.Info(), nil
}

// Ready reports whether traffic can be served: in PD mode at least one
// healthy prefill and one healthy decode worker, otherwise one healthy worker.
func (m *Manager) Ready() bool {
	s := m.reg.Snapshot()
	healthy := func(t WorkerType) bool {
		return slices.ContainsFunc(s.ByType[t], (*Worker).Healthy)
	}
	if m.cfg.PD {
		return healthy(Prefill) && healthy(Decode)
	}
	return healthy(Regular)
}
