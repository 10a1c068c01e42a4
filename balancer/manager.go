package balancer

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
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
	DPAware          bool          // --dp-aware: one worker per DP rank of each engine (dp_size from /server_info)
	UpstreamHTTP2    bool          // --upstream-http2: a plain-http worker whose /server_info says enable_http2 is sent h2c
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
	// ErrTooManyPending refuses a registration while maxPending others
	// still wait for their workers (each holds a goroutine for up to the
	// startup timeout).
	ErrTooManyPending = errors.New("too many pending worker registrations")
)

// Bounds on registration jobs: running ones, and failed ones kept for GET
// /workers/{id} (the oldest is forgotten first).
const (
	maxPending    = 1024
	maxFailedJobs = 256
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

	mu       sync.Mutex
	jobs     map[string]*job // by worker id: running or failed registrations
	failures int64           // failed jobs so far, numbering them
	// maxPending and maxFailed bound jobs (tests lower them).
	maxPending, maxFailed int
}

type job struct {
	w      *Worker
	failed int64      // sequence number of the failure, 0 while running: the oldest failed job goes first
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
	m := &Manager{cfg: cfg, reg: NewRegistry(), client: cfg.Client, log: cfg.Logger, jobs: map[string]*job{},
		maxPending: maxPending, maxFailed: maxFailedJobs}
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
	if old := m.lookup(w.URL); old != nil {
		return old.ID, fmt.Errorf("%w: %s", ErrWorkerExists, w.URL)
	}
	pending := 0
	for id, j := range m.jobs {
		if j.w.URL == w.URL {
			if j.failed == 0 {
				return id, fmt.Errorf("%w: %s", ErrWorkerExists, w.URL)
			}
			delete(m.jobs, id) // a failed attempt may be retried
		}
		if j.failed == 0 {
			pending++
		}
	}
	if pending >= m.maxPending {
		return "", fmt.Errorf("%w: %d wait for their workers", ErrTooManyPending, pending)
	}
	ctx, cancel := context.WithCancel(m.ctx)
	j := &job{w: w, status: newJobStatus(w.URL, JobPending, ""), cancel: cancel, done: make(chan struct{})}
	m.jobs[w.ID] = j
	m.wg.Go(func() { m.register(ctx, j) })
	return w.ID, nil
}

func (m *Manager) newWorker(spec WorkerSpec) (*Worker, error) {
	base, err := canonicalURL(spec.URL)
	if err != nil {
		return nil, err
	}
	typ, ok := ParseWorkerType(spec.WorkerType)
	if !ok {
		return nil, fmt.Errorf("%w: worker_type %q", ErrInvalidWorker, spec.WorkerType)
	}
	port := spec.BootstrapPort
	if port <= 0 || typ != Prefill {
		port = NoBootstrapPort
	}
	w := NewWorker(base, typ, port)
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
	return w, nil
}

// canonicalURL is a worker's identity: scheme and host in lower case, no
// userinfo, no trailing slash. Credentials in a URL are never sent (the
// worker's api_key is) and must not show in /workers or the log; without
// this, http://user:pw@host would also register host a second time.
func canonicalURL(raw string) (string, error) {
	u, err := url.Parse(raw)
	if err != nil || (!strings.EqualFold(u.Scheme, "http") && !strings.EqualFold(u.Scheme, "https")) || u.Host == "" {
		return "", fmt.Errorf("%w: url %q must be http(s)://host[:port]", ErrInvalidWorker, redactURL(raw, u, err))
	}
	u.User = nil
	u.Scheme, u.Host = strings.ToLower(u.Scheme), strings.ToLower(u.Host)
	return strings.TrimRight(u.String(), "/"), nil
}

// redactURL is raw with the password of its userinfo replaced, for errors
// that quote a URL they refuse.
func redactURL(raw string, u *url.URL, err error) string {
	if err != nil {
		return "(unparsable)"
	}
	return u.Redacted()
}

// register is one AddWorker job: wait for health, discover, publish (with
// --dp-aware, one worker per DP rank, all in one snapshot).
func (m *Manager) register(ctx context.Context, j *job) {
	defer j.cancel()
	w := j.w
	m.setStatus(j, JobProcessing, "waiting for "+m.cfg.Health.Endpoint)
	err := m.awaitHealthy(ctx, w)
	var info serverInfo
	if err == nil && (w.ModelID == "unknown" || m.cfg.DPAware || m.cfg.UpstreamHTTP2) {
		info, err = m.discover(ctx, w)
	}
	m.mu.Lock()
	switch {
	case m.jobs[w.ID] != j: // removed (or shutting down) meanwhile: do not publish
		err = cmp.Or(err, ErrWorkerNotFound)
	case err != nil:
		m.fail(j, err)
		m.log.Warn("worker registration failed", zap.String("url", w.URL), zap.Error(err))
	default:
		if w.ModelID == "unknown" { // under mu: Get may be reading the pending worker
			w.ModelID = cmp.Or(info.model, w.ModelID)
		}
		w.HTTP2 = m.cfg.UpstreamHTTP2 && info.http2 && strings.HasPrefix(w.BaseURL, "http://")
		ws := m.ranks(w, info.dpSize)
		for _, rw := range ws {
			m.cfg.Metrics.instrument(rw) // series only for published workers: forget removes them
		}
		if _, added := m.reg.AddAll(ws); added {
			delete(m.jobs, w.ID)
			m.log.Info("worker registered", zap.String("url", w.URL), zap.String("type", w.Type.String()),
				zap.String("model", w.ModelID), zap.Int("dp_ranks", len(ws)))
		} else {
			err = fmt.Errorf("%w: %s", ErrWorkerExists, w.URL)
			m.fail(j, err)
		}
	}
	j.err = err
	m.mu.Unlock()
	close(j.done)
}

// ranks is what registering w publishes: w itself, or with --dp-aware one
// worker per DP rank ("URL@0".."URL@N-1"); rank 0 keeps the job's id, so
// that Await and GET /workers/{id} find the registration.
func (m *Manager) ranks(w *Worker, dpSize int) []*Worker {
	if !m.cfg.DPAware {
		return []*Worker{w}
	}
	ws := make([]*Worker, max(dpSize, 1))
	for i := range ws {
		ws[i] = w.rank(i, len(ws), m.cfg.Breaker)
	}
	ws[0].ID = w.ID
	return ws
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

// serverInfo is what registration reads from SGLang's /server_info.
type serverInfo struct {
	model  string // served_model_name, else model_path; "" if neither
	dpSize int    // dp_size; 0 when not reported
	http2  bool   // enable_http2: the engine serves h2c beside HTTP/1.1 (SGLang's --enable-http2)
}

// maxDPSize bounds the ranks one engine may expand into (a misreporting
// engine must not make the router allocate without limit).
const maxDPSize = 1024

// parseServerInfo reads a /server_info reply. A dp_size that is not an
// integer in 1..maxDPSize is an error: routing by it would send requests to
// ranks the engine lacks.
func parseServerInfo(body []byte) (serverInfo, error) {
	var raw struct {
		ServedModelName any    `json:"served_model_name"` // a string, or a list in some SGLang versions
		ModelPath       string `json:"model_path"`
		DPSize          any    `json:"dp_size"`
		EnableHTTP2     any    `json:"enable_http2"` // read loosely: a wrong type only means no h2c
	}
	if err := json.Unmarshal(body, &raw); err != nil {
		return serverInfo{}, err
	}
	info := serverInfo{model: raw.ModelPath, http2: raw.EnableHTTP2 == true}
	switch n := raw.ServedModelName.(type) {
	case string:
		info.model = cmp.Or(n, info.model)
	case []any:
		if len(n) > 0 {
			if s, _ := n[0].(string); s != "" {
				info.model = s
			}
		}
	}
	switch d := raw.DPSize.(type) {
	case nil:
	case float64:
		if d != float64(int(d)) || d < 1 || d > maxDPSize {
			return info, fmt.Errorf("dp_size %v: want an integer in 1..%d", d, maxDPSize)
		}
		info.dpSize = int(d)
	default:
		return info, fmt.Errorf("dp_size %v: want an integer in 1..%d", d, maxDPSize)
	}
	return info, nil
}

// discover reads the model name and dp_size from /server_info, falling back
// to /get_server_info (the 0.3.x order). Without --dp-aware failures only
// leave the model unknown. With it, an engine that reports no dp_size (or
// serves neither endpoint) is one rank, but one that cannot be read after
// three tries fails the registration: guessing one rank for an engine of
// eight would send it all to rank 0.
func (m *Manager) discover(ctx context.Context, w *Worker) (serverInfo, error) {
	var err error
	for try := range 3 {
		var info serverInfo
		if info, err = m.readServerInfo(ctx, w); err == nil {
			return info, nil
		}
		if !m.cfg.DPAware || ctx.Err() != nil {
			break
		}
		t := time.NewTimer(time.Duration(try+1) * 200 * time.Millisecond)
		select {
		case <-ctx.Done():
		case <-t.C:
		}
		t.Stop()
	}
	if !m.cfg.DPAware {
		return serverInfo{}, nil
	}
	return serverInfo{}, fmt.Errorf("--dp-aware: reading dp_size of %s: %w", w.URL, err)
}

// readServerInfo is one try of discover.
func (m *Manager) readServerInfo(ctx context.Context, w *Worker) (serverInfo, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	for _, path := range []string{"/server_info", "/get_server_info"} {
		body, status, err := getBody(ctx, m.client, w, path)
		if err != nil {
			return serverInfo{}, err
		}
		if status/100 != 2 {
			continue
		}
		info, err := parseServerInfo(body)
		if err != nil {
			return serverInfo{}, fmt.Errorf("%s: %w", path, err)
		}
		return info, nil
	}
	return readModels(ctx, m.client, w), nil // neither endpoint (vLLM): the model from /v1/models
}

// fail marks j failed and forgets the oldest failed job past
// maxFailedJobs. Caller holds mu.
func (m *Manager) fail(j *job, err error) {
	j.status = newJobStatus(j.w.URL, JobFailed, err.Error())
	m.failures++
	j.failed = m.failures
	var oldest *job
	n := 0
	for _, o := range m.jobs {
		if o.failed > 0 {
			n++
			if oldest == nil || o.failed < oldest.failed {
				oldest = o
			}
		}
	}
	if n > m.maxFailed {
		delete(m.jobs, oldest.w.ID)
	}
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
	for _, u := range urlKeys(idOrURL) {
		for _, j := range m.jobs {
			if j.w.URL == u {
				return j
			}
		}
	}
	return nil
}

// urlKeys are the URLs idOrURL may name a worker by: as given (less a
// trailing slash: "BASE@RANK" must not go through url.Parse, which reads
// "host:port@" as userinfo) and in canonical form.
func urlKeys(idOrURL string) []string {
	u := strings.TrimRight(idOrURL, "/")
	if c, err := canonicalURL(idOrURL); err == nil && c != u {
		return []string{u, c}
	}
	return []string{u}
}

// lookup finds a worker by id or URL; an engine's base URL finds its first
// DP rank.
func (m *Manager) lookup(idOrURL string) *Worker {
	if ws := m.lookupAll(idOrURL); len(ws) > 0 {
		return ws[0]
	}
	return nil
}

// lookupAll finds a worker by id or URL, or every DP rank of an engine by
// its base URL or by the id its registration returned (rank 0's).
func (m *Manager) lookupAll(idOrURL string) []*Worker {
	s := m.reg.Snapshot()
	if w := s.ByID(idOrURL); w != nil {
		if w.DPSize > 0 && w.DPRank == 0 {
			return s.ByBaseURL(w.BaseURL)
		}
		return []*Worker{w}
	}
	for _, u := range urlKeys(idOrURL) {
		if w := s.ByURL(u); w != nil {
			return []*Worker{w}
		}
		if ws := s.ByBaseURL(u); len(ws) > 0 {
			return ws
		}
	}
	return nil
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
	ws := m.lookupAll(idOrURL)
	if len(ws) == 0 {
		return WorkerInfo{}, false
	}
	key := ws[0].URL // a worker, or with a base URL all its engine's ranks
	if len(ws) > 1 {
		key = ws[0].BaseURL
	}
	gone, ok := m.reg.Remove(key)
	if !ok {
		return WorkerInfo{}, false
	}
	for _, w := range gone {
		m.cfg.Metrics.forget(w.URL)
		m.log.Info("worker removed", zap.String("url", w.URL))
	}
	return gone[0].Info(), true
}

// Update changes a registered worker's priority, cost, labels or API key;
// an engine's base URL updates all its DP ranks.
func (m *Manager) Update(idOrURL string, u WorkerUpdate) (WorkerInfo, error) {
	ws := m.lookupAll(idOrURL)
	var first *Worker
	for _, w := range ws {
		nw, ok := m.reg.update(w.ID, func(cur *Worker) *Worker { return cur.withAttrs(u) })
		if ok && first == nil {
			first = nw
		}
	}
	if first == nil {
		return WorkerInfo{}, ErrWorkerNotFound
	}
	return first.Info(), nil
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
