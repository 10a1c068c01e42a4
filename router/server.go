// Package router is pdrouter's HTTP front end and request path: the PD
// request path (pd.go) and regular load balancing (regular.go). What is
// not the request path lives beside it: the control plane in admin
// (worker API) and cpauth (who may call it), deployment checks in doctor,
// the info endpoints and their fan-out in info, byte-level JSON/SSE work
// in splice, and the replies the router makes itself in respond.
package router

import (
	"cmp"
	"context"
	"crypto/tls"
	"math/rand/v2"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/valyala/fasthttp"
	"go.uber.org/zap"

	"github.com/pdrouter/pdrouter/balancer"
	"github.com/pdrouter/pdrouter/internal/redact"
	"github.com/pdrouter/pdrouter/router/admin"
	"github.com/pdrouter/pdrouter/router/cpauth"
	"github.com/pdrouter/pdrouter/router/doctor"
	"github.com/pdrouter/pdrouter/router/info"
	"github.com/pdrouter/pdrouter/router/respond"
)

// routeKind names the generation endpoints; it is also the metrics label.
type routeKind uint8

const (
	routeGenerate routeKind = iota
	routeChat
	routeCompletions
	routeRerank
	routeEmbeddings
	routeClassify
	routeResponses
)

var routeNames = [...]string{"generate", "chat", "completions", "rerank", "embeddings", "classify", "responses"}

func (r routeKind) String() string { return routeNames[r] }

// Server is the router. Create it with New, then Serve.
type Server struct {
	cfg       Config
	log       *zap.Logger
	reg       *balancer.Registry
	manager   *balancer.Manager
	admission *balancer.Admission
	// policies pick the worker of each type a request goes to: Regular, or
	// Prefill and Decode in PD mode (the others stay nil).
	policies  [3]balancer.Policy
	needsText bool         // some policy reads the request's routing text
	upstream  *upstream    // generation requests to workers
	inflight  *inflight    // generation requests in progress
	draining  atomic.Bool  // Shutdown has begun
	infoCalls *http.Client // info endpoints, their fan-out, the doctor and engine aborts
	info      *info.Endpoints
	admin     *admin.API // the control plane: worker API, /flush_cache, /get_loads, /doctor
	metrics   *metrics
	bm        *balancer.Metrics
	srv       *fasthttp.Server
	front     frontLimit // the client connection limit (limits.go)

	frontTLS  *tls.Config // nil = plain HTTP (tls.go)
	workerTLS *tls.Config // https workers; nil = system roots

	// base is cancelled on hard shutdown; admin and info calls derive from
	// it (generation requests are cancelled by the inflight tracker).
	base       context.Context
	cancelBase context.CancelFunc
	background sync.WaitGroup // prefill legs that outlive their handler, engine aborts
	aborts     engineAborts
	large      largeBodies  // hands large bodies' memory back (body.go)
	live       atomic.Int64 // generation requests not yet released (request.go)
	pdm        *pdMetrics
	trace      *tracer // nil: tracing off (trace.go)

	// requestIDNames are --request-id-headers as fasthttp normalizes names.
	requestIDNames []string

	loops     *evLoops // nil: off (evloop.go)
	loopsOnce sync.Once
}

// New builds a router from cfg, which must pass Config.Validate. Metrics
// are registered on promReg.
func New(cfg Config, log *zap.Logger, promReg prometheus.Registerer) (*Server, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	log = redact.Logger(log) // no credential reaches a log line
	s := &Server{cfg: cfg, log: log, metrics: newMetrics(promReg), pdm: newPDMetrics(promReg)}
	if cfg.VLLMPDDisaggregation {
		s.pdm.runtime = "vllm"
	}
	var err error
	if s.bm, err = balancer.NewMetrics(promReg); err != nil {
		return nil, err
	}
	cfg.PolicyOptions.Metrics = s.bm
	for _, t := range s.sides() {
		if s.policies[t], err = balancer.NewPolicy(policyName(&cfg, t), cfg.PolicyOptions); err != nil {
			return nil, err
		}
		s.needsText = s.needsText || s.policies[t].NeedsText()
	}
	s.admission = balancer.NewAdmission(cfg.Admission)
	for _, h := range cfg.RequestIDHeaders {
		s.requestIDNames = append(s.requestIDNames, string(fasthttp.AppendNormalizedHeaderKey(nil, h)))
	}
	s.base, s.cancelBase = context.WithCancel(context.Background())
	if err := s.secure(); err != nil {
		s.cancelBase()
		return nil, err
	}
	auth, err := cpauth.New(s.base, cfg.ControlPlane, cfg.APIKey, log) // a JWKS refresher ends with s.base
	if err != nil {
		s.cancelBase()
		return nil, err
	}
	if s.trace, err = newTracer(cfg.Trace, log); err != nil {
		s.cancelBase()
		return nil, err
	}
	s.upstream = newUpstream(cfg.UpstreamIdleTimeout)
	s.upstream.maxIdle = poolLimit()
	s.upstream.tls = s.workerTLS
	s.inflight = newInflight(cfg.RequestTimeout)
	s.infoCalls = newInfoClient(s.workerTLS, 50*time.Second, log)
	mcfg := cfg.Manager
	mcfg.PD = cfg.PDDisaggregation
	mcfg.Logger = log
	mcfg.Metrics = s.bm
	if mcfg.Client == nil { // probes, load polls, registration
		mcfg.Client = newInfoClient(s.workerTLS, 90*time.Second, log)
	}
	s.manager = balancer.NewManager(mcfg)
	s.reg = s.manager.Registry()
	s.reg.OnChange(s.followWorkers)
	s.reg.OnChange(s.followLimit) // limits.go
	for _, t := range s.sides() {
		s.manager.AttachPolicy(s.policies[t])
	}
	s.info = &info.Endpoints{Workers: s.reg, Ready: s.manager.Ready, PD: cfg.PDDisaggregation,
		Client: s.infoCalls, APIKey: cfg.APIKey, Base: s.base}
	s.admin = &admin.API{Auth: auth, Workers: s.manager, URLs: s.workerURLs, PD: cfg.PDDisaggregation,
		Base: s.base, AddTimeout: cfg.Manager.StartupTimeout, Doctor: s.Doctor}
	s.srv = &fasthttp.Server{
		Handler:                       s.handle,
		Name:                          "pdrouter",
		MaxRequestBodySize:            cfg.MaxPayloadSize,
		ExpectHandler:                 s.expectContinue,
		ErrorHandler:                  s.transportError,
		ReadBufferSize:                cfg.MaxHeaderSize, // the whole head must fit
		ReadTimeout:                   cfg.HeaderReadTimeout,
		HeaderReceived:                s.bodyDeadline,
		IdleTimeout:                   cfg.IdleConnectionTimeout,
		WriteTimeout:                  cfg.RequestTimeout + writeGrace, // a client that stops reading frees its stream
		SecureErrorLogMessage:         true,
		Logger:                        fasthttpLog{log},
		NoDefaultServerHeader:         true,
		LazyRequestTime:               true, // nothing reads ctx.Time(): no clock read per request for it
		DisableHeaderNamesNormalizing: false,
		CloseOnShutdown:               true,
		// A PD stream then holds no read buffer (MaxHeaderSize, 64 KiB by
		// default) while it streams: fasthttp returns it to its pool once
		// the request is read. The price is one more read per keep-alive
		// request, within the noise of PD's own cost but ~10 % of a regular
		// request's, so regular mode keeps its buffer (bench/RESULTS.md).
		ReduceMemoryUsage: cfg.PDDisaggregation,
		KeepHijackedConns: true, // a PD stream's connection is served again after it (streamconn.go)
		ConnState: func(_ net.Conn, st fasthttp.ConnState) {
			switch st {
			case fasthttp.StateNew:
				s.metrics.httpConnections.Inc()
			case fasthttp.StateClosed, fasthttp.StateHijacked:
				s.metrics.httpConnections.Dec()
			}
		},
	}
	return s, nil
}

// bodyDeadline gives the body its own read timeout once the head is in
// (fasthttp's ReadTimeout, the header read timeout, covers the head), and
// leaves large bodies to the router (frameBody).
func (s *Server) bodyDeadline(h *fasthttp.RequestHeader) fasthttp.RequestConfig {
	s.frameBody(h)
	return fasthttp.RequestConfig{ReadTimeout: s.cfg.BodyReadTimeout}
}

// followWorkers closes the connections of workers that left the registry.
func (s *Server) followWorkers(snap *balancer.Snapshot) {
	if s.upstream.follow(snap) {
		s.infoCalls.CloseIdleConnections() // net/http closes them all, not one host's
	}
}

// policyName is the policy cfg gives workers of type t: PD mode may name
// one per side, falling back to --policy.
func policyName(cfg *Config, t balancer.WorkerType) string {
	switch t {
	case balancer.Prefill:
		return cmp.Or(cfg.PrefillPolicy, cfg.Policy)
	case balancer.Decode:
		return cmp.Or(cfg.DecodePolicy, cfg.Policy)
	}
	return cfg.Policy
}

// Start registers the CLI workers in the background (the listener does not
// wait for them, as in 0.3.x) and starts health checking.
func (s *Server) Start() error {
	if err := s.manager.Start(); err != nil {
		return err
	}
	var specs []balancer.WorkerSpec
	if s.cfg.PDDisaggregation {
		for _, p := range s.cfg.Prefill {
			specs = append(specs, balancer.WorkerSpec{URL: p.URL, WorkerType: balancer.Prefill.String(), BootstrapPort: p.BootstrapPort})
		}
		for _, d := range s.cfg.Decode {
			specs = append(specs, balancer.WorkerSpec{URL: d, WorkerType: balancer.Decode.String()})
		}
	} else {
		for _, u := range s.cfg.WorkerURLs {
			specs = append(specs, balancer.WorkerSpec{URL: u, WorkerType: balancer.Regular.String()})
		}
	}
	for _, spec := range specs {
		if _, err := s.manager.Add(spec); err != nil {
			s.log.Warn("worker not registered", zap.String("url", spec.URL), zap.Error(err))
		}
	}
	return nil
}

// Serve answers requests on ln until Shutdown.
func (s *Server) Serve(ln net.Listener) error {
	ln = s.limitListener(ln)
	var err error
	s.loopsOnce.Do(func() { s.loops, err = newEvLoops(s, s.cfg.EventLoops) })
	if err != nil {
		return err
	}
	if s.loops != nil {
		ln = loopListener{Listener: ln, loops: s.loops}
	}
	// Large bodies are read from the connection (body.go).
	if s.cfg.PDDisaggregation {
		ln = headListener{Listener: s.listener(ln), firstByteWait: true}
	} else {
		ln = headListener{Listener: s.listener(lazyDeadlineListener{ln})} // deadline.go
	}
	return s.srv.Serve(ln)
}

// Shutdown stops accepting, lets in-flight requests and streams finish
// until ctx ends, then cancels what is left.
func (s *Server) Shutdown(ctx context.Context) error {
	s.draining.Store(true)            // a stream's connection closes at its end (streamconn.go)
	s.inflight.watcher.lot.closeAll() // and those idle since a stream close now (parkconn.go)
	s.loopsOnce.Do(func() {})         // Serve's, if it ran: s.loops is set
	s.loops.shutdown(ctx)             // first: what the loops hand off, fasthttp's shutdown closes
	err := s.srv.ShutdownWithContext(ctx)
	s.awaitStreams(ctx) // hijacked streams, which fasthttp does not wait for
	s.cancelBase()
	s.inflight.close()
	s.awaitRequests(s.cfg.AbortTimeout + time.Second)
	s.loops.awaitHandoffs(ctx) // fasthttp has closed them, or their requests are cancelled
	s.aborts.close()
	s.background.Wait()
	s.trace.shutdown()
	s.large.stop()
	s.manager.Stop()
	s.infoCalls.CloseIdleConnections()
	s.upstream.close()
	return err
}

// awaitRequests gives the requests cancelled at shutdown up to d to end,
// so that the engine aborts their legs send start before Shutdown stops
// aborts. A stream blocked writing to a client that stopped reading may
// outlast d (until --request-timeout-secs); its abort is then dropped.
func (s *Server) awaitRequests(d time.Duration) {
	deadline := time.Now().Add(d)
	for s.live.Load() > 0 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
}

// Registry exposes the worker registry (tests, admin).
func (s *Server) Registry() *balancer.Registry { return s.reg }

// workerURLs lists the registered workers' URLs (/list_workers).
func (s *Server) workerURLs() []string {
	urls := []string{}
	for _, w := range s.reg.Snapshot().All {
		urls = append(urls, w.URL)
	}
	return urls
}

// Doctor checks the deployment (router/doctor): the workers the
// configuration names and any registered since.
func (s *Server) Doctor(ctx context.Context) []doctor.Finding {
	workers := doctor.Engines(s.configuredWorkers(), s.reg.Snapshot().All)
	return doctor.Run(ctx, workers, s.cfg.PDDisaggregation, doctor.HTTPGetter(s.infoCalls))
}

func (s *Server) configuredWorkers() []*balancer.Worker {
	var ws []*balancer.Worker
	for _, u := range s.cfg.WorkerURLs {
		ws = append(ws, balancer.NewWorker(u, balancer.Regular, balancer.NoBootstrapPort))
	}
	for _, p := range s.cfg.Prefill {
		ws = append(ws, balancer.NewWorker(p.URL, balancer.Prefill, p.BootstrapPort))
	}
	for _, u := range s.cfg.Decode {
		ws = append(ws, balancer.NewWorker(u, balancer.Decode, balancer.NoBootstrapPort))
	}
	return ws
}

// handle is the outermost layer: CORS, request id, metrics, auth, routing.
func (s *Server) handle(ctx *fasthttp.RequestCtx) {
	start := time.Now()
	s.setRequestID(ctx)
	method, known := knownMethod(ctx.Method())
	if !known {
		refuseMethod(ctx)
		unconsumedBody(ctx)
		s.metrics.observeHTTP(otherMethod, "other", ctx.Response.StatusCode(), errorCode(ctx), since(start))
		return
	}
	if s.cors(ctx) {
		unconsumedBody(ctx)
		return
	}
	if e := s.readBody(ctx); e != nil {
		writeError(ctx, e)
		ctx.SetConnectionClose() // the rest of the body is not read
		s.metrics.observeHTTP(method, "other", ctx.Response.StatusCode(), errorCode(ctx), since(start))
		return
	}
	var label string
	if g, ok := generationRoutes[bstr(ctx.Path())]; ok {
		label = s.generation(ctx, method, g.path, g.kind)
	} else {
		label = s.route(ctx, string(ctx.Path()), method)
	}
	if !ctx.Hijacked() { // a stream is counted when its attempts are done (serveStream)
		s.metrics.observeHTTP(method, label, ctx.Response.StatusCode(), errorCode(ctx), since(start))
	}
}

// knownMethod returns m as one of the methods the router serves (a
// constant, so no request copies fasthttp's bytes); any other is answered
// 405 and counted as OTHER, so clients cannot mint metric series.
func knownMethod(m []byte) (string, bool) {
	for _, k := range servedMethods {
		if string(m) == k {
			return k, true
		}
	}
	return "", false
}

var servedMethods = [...]string{"POST", "GET", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH"}

// otherMethod is the metrics label of every method knownMethod refuses.
const otherMethod = "OTHER"

// refuseMethod answers a method the router does not serve.
func refuseMethod(ctx *fasthttp.RequestCtx) {
	writeError(ctx, &apiError{Status: 405, Code: "method_not_allowed", Message: "method not allowed"})
	ctx.Response.Header.Set("Allow", "GET, POST, PUT, DELETE, HEAD, OPTIONS, PATCH")
}

type generationRoute struct {
	path string
	kind routeKind
}

// generationRoutes are the routes that go to workers, by path. The request
// keeps the table's path string (and metrics label with it), so the hot
// requests never copy fasthttp's.
var generationRoutes = func() map[string]generationRoute {
	m := map[string]generationRoute{}
	for _, g := range []generationRoute{{"/generate", routeGenerate}, {"/v1/chat/completions", routeChat},
		{"/v1/completions", routeCompletions}, {"/v1/rerank", routeRerank}, {"/rerank", routeRerank},
		{"/v1/embeddings", routeEmbeddings}, {"/v1/classify", routeClassify}, {"/v1/responses", routeResponses}} {
		m[g.path] = g
	}
	return m
}()

// route dispatches every other path and returns its label for metrics
// (known routes only, so label cardinality stays bounded).
func (s *Server) route(ctx *fasthttp.RequestCtx, path, method string) string {
	switch path {
	case "/health", "/liveness":
		ctx.SetContentType("text/plain; charset=utf-8")
		ctx.SetBodyString("OK")
	case "/readiness":
		s.info.Readiness(ctx)
	case "/health_generate":
		s.info.HealthGenerate(ctx)
	case "/v1/models":
		s.info.Models(ctx)
	case "/get_model_info":
		s.info.ModelInfo(ctx)
	case "/get_server_info", "/server_info":
		s.info.ServerInfo(ctx)
	case "/flush_cache":
		if respond.RequireMethod(ctx, method, "POST") {
			s.admin.Gate(ctx, s.info.FlushCache)
		}
	case "/get_loads":
		s.admin.Gate(ctx, s.info.Loads)
	case "/doctor":
		s.admin.Gate(ctx, s.admin.ServeDoctor)
	case "/engine_metrics":
		s.info.EngineMetrics(ctx)
	default:
		if s.admin.ServeWorkers(ctx, path, method) {
			return "/workers"
		}
		ctx.SetStatusCode(fasthttp.StatusNotFound)
		return "other"
	}
	return path
}

// authorized enforces --api-key on protected and admin routes.
func (s *Server) authorized(ctx *fasthttp.RequestCtx) bool {
	if s.cfg.APIKey == "" {
		return true
	}
	auth := ctx.Request.Header.Peek("Authorization")
	if len(auth) > 7 && strings.EqualFold(bstr(auth[:7]), "Bearer ") && bstr(auth[7:]) == s.cfg.APIKey {
		return true
	}
	writeError(ctx, &apiError{Status: 401, Code: "unauthorized", Message: "missing or invalid API key"})
	return false
}

// cors applies the CORS policy; it answers preflights itself.
func (s *Server) cors(ctx *fasthttp.RequestCtx) bool {
	origin := ctx.Request.Header.Peek("Origin")
	if len(origin) == 0 {
		return false
	}
	allowed := len(s.cfg.CORSOrigins) == 0
	for _, o := range s.cfg.CORSOrigins {
		if o == "*" || o == string(origin) {
			allowed = true
		}
	}
	if !allowed {
		return false
	}
	h := &ctx.Response.Header
	if len(s.cfg.CORSOrigins) == 0 {
		h.Set("Access-Control-Allow-Origin", "*")
	} else {
		h.SetBytesV("Access-Control-Allow-Origin", origin)
		h.Set("Vary", "Origin")
	}
	h.Set("Access-Control-Expose-Headers", "x-request-id, x-smg-error-code")
	if ctx.IsOptions() && len(ctx.Request.Header.Peek("Access-Control-Request-Method")) > 0 {
		h.Set("Access-Control-Allow-Methods", "GET, POST, PUT, DELETE, OPTIONS")
		if req := ctx.Request.Header.Peek("Access-Control-Request-Headers"); len(req) > 0 {
			h.SetBytesV("Access-Control-Allow-Headers", req)
		} else {
			h.Set("Access-Control-Allow-Headers", "*")
		}
		h.Set("Access-Control-Max-Age", "3600")
		ctx.SetStatusCode(fasthttp.StatusNoContent)
		return true
	}
	return false
}

const requestIDAlphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"

// setRequestID echoes the client's id (first of --request-id-headers) or
// makes one with sglang-router's prefixes, and sets it on the response.
func (s *Server) setRequestID(ctx *fasthttp.RequestCtx) {
	if id := clientRequestID(&ctx.Request.Header, s.requestIDNames); id != nil {
		ctx.Response.Header.SetCanonical(headerRequestID, id)
		return
	}
	path := bstr(ctx.Path())
	prefix := "req-"
	switch {
	case strings.Contains(path, "/chat/completions"):
		prefix = "chatcmpl-"
	case strings.Contains(path, "/completions"):
		prefix = "cmpl-"
	case strings.Contains(path, "/generate"):
		prefix = "gnt-"
	case strings.Contains(path, "/responses"):
		prefix = "resp-"
	}
	var space [len("chatcmpl-") + 24]byte // the header copies it
	id := space[:len(prefix)+24]
	copy(id, prefix)
	// Ten base-62 digits per random word (62^10 < 2^64): three draws
	// instead of one per character.
	var x uint64
	for i := len(prefix); i < len(id); i++ {
		if (i-len(prefix))%10 == 0 {
			x = rand.Uint64()
		}
		id[i] = requestIDAlphabet[x%62]
		x /= 62
	}
	ctx.Response.Header.SetCanonical(headerRequestID, id)
}

// headerRequestID is X-Request-Id normalized, set without normalizing it
// again for every request.
var headerRequestID = []byte("X-Request-Id")

// clientRequestID is the value of the first of names (normalized, in
// their order) that h carries, as Peek finds one: a name's first
// occurrence, empty counting as none; nil if none. One pass over the
// headers instead of one Peek per name, each normalizing the name and
// scanning every header.
func clientRequestID(h *fasthttp.RequestHeader, names []string) []byte {
	var id []byte
	found := len(names) // id is the value of names[found]
	var seen uint64     // the first 64 names met so far: later occurrences are not Peek's
	for k, v := range h.All() {
		for i, name := range names[:found] {
			if bstr(k) != name {
				continue
			}
			if i < 64 {
				if seen&(1<<i) != 0 {
					break
				}
				seen |= 1 << i
			}
			if len(v) > 0 {
				id, found = v, i
			}
			break
		}
	}
	return id
}
