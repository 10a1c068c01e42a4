package mockworker

import (
	"context"
	"crypto/subtle"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Server is a running mock worker.
type Server struct {
	cfg      Config
	workerID string
	idPrefix string // hex of the worker id, keeps response ids unique across workers
	ln       net.Listener
	srv      *http.Server
	rec      *recorder
	aborts   abortLog
	vkv      vllmKV // the vLLM roles' KV (vllm.go)
	polls    loadPolls
	started  time.Time

	seq     atomic.Uint64 // response id counter
	failed  atomic.Int64  // generation requests seen by fail-first-n
	crashed atomic.Bool

	rngMu sync.Mutex
	rng   *rand.Rand

	// Close cancels every request context, then waits for handlers and Serve.
	cancel   context.CancelFunc
	mu       sync.Mutex
	closing  bool
	handlers sync.WaitGroup
	done     chan struct{}
	serveErr error
}

// errClientGone marks a request whose client disconnected before the end.
var errClientGone = errors.New("client gone")

// Start validates cfg, binds the listener and serves in the background until
// Close.
func Start(cfg Config) (*Server, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", net.JoinHostPort(cfg.Host, strconv.Itoa(cfg.Port)))
	if err != nil {
		return nil, fmt.Errorf("mockworker: listen: %w", err)
	}
	if ln, err = cfg.listen(ln); err != nil {
		return nil, err
	}
	s := &Server{cfg: cfg, workerID: cfg.WorkerID, ln: ln, rec: newRecorder(cfg.RecordLimit, cfg.Engine.DPSize),
		started: time.Now(), done: make(chan struct{})}
	if s.workerID == "" {
		s.workerID = "worker-" + strconv.Itoa(ln.Addr().(*net.TCPAddr).Port)
	}
	h := fnv.New32a()
	h.Write([]byte(s.workerID))
	s.idPrefix = fmt.Sprintf("%08x", h.Sum32())
	seed := uint64(cfg.Seed)
	if seed == 0 {
		seed = uint64(time.Now().UnixNano())
	}
	s.rng = rand.New(rand.NewPCG(seed, seed^0x5DEECE66D))

	baseCtx, cancel := context.WithCancel(context.Background())
	s.cancel = cancel
	s.srv = &http.Server{
		Handler:           s.routes(),
		ReadHeaderTimeout: 10 * time.Second,
		BaseContext:       func(net.Listener) context.Context { return baseCtx },
	}
	if cfg.HTTP2 {
		var p http.Protocols
		p.SetHTTP1(true)
		p.SetUnencryptedHTTP2(true)
		s.srv.Protocols = &p
	}
	go func() {
		defer close(s.done)
		if err := s.srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
			s.serveErr = err
		}
	}()
	return s, nil
}

// Addr is the bound host:port.
func (s *Server) Addr() string { return s.ln.Addr().String() }

// URL is http://host:port, or https:// with TLS.
func (s *Server) URL() string { return s.cfg.scheme() + s.Addr() }

// WorkerID is the id sent in X-Worker-Id and worker_id.
func (s *Server) WorkerID() string { return s.workerID }

// Done is closed when the server stops serving.
func (s *Server) Done() <-chan struct{} { return s.done }

// Close stops the server: open requests see their context cancelled (a
// hanging or streaming request ends as client_gone). It returns once every
// handler has returned.
func (s *Server) Close() error {
	s.mu.Lock()
	s.closing = true
	s.mu.Unlock()
	s.cancel()
	err := s.srv.Close()
	s.handlers.Wait()
	s.vkv.close()
	<-s.done
	return errors.Join(err, s.serveErr)
}

// Requests returns the recorded generation requests, oldest first.
func (s *Server) Requests() []RecordedRequest { return s.rec.requests() }

// Stats returns the generation request counters.
func (s *Server) Stats() Stats {
	st, _, _, _ := s.rec.snapshot()
	st.V1LoadPolls, st.GetLoadPolls = s.polls.v1.Load(), s.polls.legacy.Load()
	return st
}

// Reset clears the recorded requests and the counters (except in_flight).
func (s *Server) Reset() {
	s.rec.reset()
	s.aborts.reset()
	s.vkv.reset()
}

func (s *Server) routes() http.Handler {
	mux := http.NewServeMux()
	for path, ep := range map[string]endpoint{
		"/generate":            epGenerate,
		"/v1/chat/completions": epChat,
		"/v1/completions":      epCompletions,
		"/v1/embeddings":       epEmbeddings,
		"/v1/classify":         epClassify,
		"/v1/rerank":           epRerank,
		"/rerank":              epRerank,
		"/v1/responses":        epResponses,
	} {
		mux.Handle("POST "+path, s.generation(ep))
	}
	public := map[string]http.HandlerFunc{
		"GET /health":          s.health,
		"GET /health_generate": s.health,
		"GET /metrics":         s.metrics,
		"GET /_mock/requests":  s.mockRequests,
		"GET /_mock/stats":     s.mockStats,
		"POST /_mock/reset":    s.mockReset,
		"GET /_mock/aborts":    s.mockAborts,
	}
	for pattern, h := range public {
		mux.HandleFunc(pattern, h)
	}
	protected := map[string]http.HandlerFunc{
		"GET /v1/models":       s.models,
		"GET /get_model_info":  s.modelInfo,
		"GET /model_info":      s.modelInfo,
		"GET /get_server_info": s.serverInfo,
		"GET /server_info":     s.newServerInfo,
		"GET /get_load":        s.load,
		"GET /v1/loads":        s.v1Loads,
		"/flush_cache":         s.flushCache, // SGLang accepts GET and POST
		"POST /abort_request":  s.abortRequest,
	}
	for pattern, h := range protected {
		mux.HandleFunc(pattern, func(w http.ResponseWriter, r *http.Request) {
			if !s.authorized(r) {
				writeUnauthorized(w)
				return
			}
			h(w, r)
		})
	}
	return s.track(s.vllmRoutes(mux))
}

// track counts running handlers so Close can wait for them.
func (s *Server) track(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.mu.Lock()
		if s.closing {
			s.mu.Unlock()
			http.Error(w, "shutting down", http.StatusServiceUnavailable)
			return
		}
		s.handlers.Add(1)
		s.mu.Unlock()
		defer s.handlers.Done()
		next.ServeHTTP(w, r)
	})
}

// authorized applies SGLang's api-key rule: Bearer KEY when a key is set,
// any Bearer token with RequireAPIKey alone.
func (s *Server) authorized(r *http.Request) bool {
	if s.cfg.APIKey == "" && !s.cfg.RequireAPIKey {
		return true
	}
	token, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	if !ok {
		return false
	}
	return s.cfg.APIKey == "" || subtle.ConstantTimeCompare([]byte(token), []byte(s.cfg.APIKey)) == 1
}

func writeUnauthorized(w http.ResponseWriter) {
	_ = writeJSONBytes(w, http.StatusUnauthorized, []byte(`{"error":"Unauthorized"}`))
}

// statusWriter remembers the status for the introspection record.
type statusWriter struct {
	http.ResponseWriter
	status int
}

func (w *statusWriter) WriteHeader(code int) {
	if w.status == 0 {
		w.status = code
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *statusWriter) Write(b []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	return w.ResponseWriter.Write(b)
}

// Unwrap lets http.ResponseController reach Flush.
func (w *statusWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// consumed is what a generation request used, for /metrics.
type consumed struct{ prompt, completion int64 }

// generation serves a model-work endpoint: record, authorize, parse, apply
// the knobs, move KV in PD roles, then answer.
func (s *Server) generation(ep endpoint) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rec := s.rec.start(r)
		sw := &statusWriter{ResponseWriter: w}
		var used consumed
		outcome := FinishedError // stays so if the handler aborts (crash)
		defer func() { s.rec.finish(rec, sw.status, outcome, used.prompt, used.completion) }()
		err := s.serveGeneration(sw, r, ep, rec, &used)
		switch {
		case err != nil || (r.Context().Err() != nil && sw.status == 0):
			outcome = FinishedClientGone
		case sw.status >= 200 && sw.status < 300:
			outcome = FinishedOK
		}
	})
}

// serveGeneration returns errClientGone (or a write error) when the client
// went away; any answer it managed to send is reported through w.
func (s *Server) serveGeneration(w *statusWriter, r *http.Request, ep endpoint, rec *RecordedRequest, used *consumed) error {
	ctx := r.Context()
	w.Header().Set("X-Worker-Id", s.workerID)
	if !s.authorized(r) {
		writeUnauthorized(w)
		return nil
	}
	body, err := io.ReadAll(r.Body)
	if err != nil {
		if ctx.Err() != nil {
			return errClientGone
		}
		return writeError(w, badRequest("reading body: %v", err))
	}
	req, perr := parseRequest(ep, body, s.cfg.Engine.DPSize)
	s.rec.setBody(rec, body, req)
	if s.cfg.CrashOnRequest && s.crashed.CompareAndSwap(false, true) {
		s.cfg.Exit(1)
		panic(http.ErrAbortHandler) // only reached when Exit is a test hook
	}
	if s.cfg.Hang {
		<-ctx.Done()
		return errClientGone
	}
	if perr != nil {
		return writeError(w, perr)
	}
	if f := s.cfg.FailDPRank; f != nil && req.ranks.rank == *f {
		return writeError(w, errorf(http.StatusInternalServerError, "mock failure: DP rank %d (fail-dp-rank)", *f))
	}
	if (s.cfg.Role == RolePrefill || s.cfg.Role == RoleDecode) && ep.generates() && req.boot == nil {
		return writeError(w, badRequest("%s server requires bootstrap_host and bootstrap_room in the request", s.cfg.Role))
	}
	seqs := s.sequences(req)
	var load int64
	for _, sq := range seqs {
		load += int64(len(sq.ids) + len(sq.prompt.ids))
	}
	s.rec.begin(req.ranks.rank, load)
	defer s.rec.end(req.ranks.rank, load)

	// SGLang answers a stream's head at once and its first event after the
	// forward pass, so a stream's prefill delay comes after the head (and an
	// injected failure before it, as a status).
	var ev *sse
	if req.stream && s.cfg.PrefillDelay > 0 {
		if e := s.injectedFailure(); e != nil {
			return writeError(w, e)
		}
		ev = newSSE(w)
		if err := ev.head(); err != nil {
			return err
		}
	}
	if !sleep(ctx, s.cfg.PrefillDelay) {
		return errClientGone
	}
	if ev == nil {
		if e := s.injectedFailure(); e != nil {
			return writeError(w, e)
		}
	}
	kv, err := s.transferKV(ctx, req, seqs)
	if err != nil {
		if ctx.Err() != nil {
			return errClientGone
		}
		status := http.StatusInternalServerError
		var se interface{ HTTPStatus() int } // e.g. KV pool exhausted: 503
		if errors.As(err, &se) {
			status = se.HTTPStatus()
		}
		e := errorf(status, "KV transfer failed: %v", err)
		if ev != nil {
			return ev.write(errorBody(e.status, e.message))
		}
		return writeError(w, e)
	}
	used.prompt = int64(promptTokens(seqs))
	for _, sq := range seqs {
		used.completion += int64(len(sq.ids))
	}
	a := &answer{s: s, w: w, ctx: ctx, req: req, seqs: seqs, kv: kv, start: time.Unix(0, rec.StartedUnixNano), ev: ev}
	if s.cfg.Role.vllm() && (ep == epChat || ep == epCompletions) {
		return s.vllmAnswer(a, r)
	}
	switch ep {
	case epGenerate:
		return a.generate()
	case epChat:
		return a.chat()
	case epCompletions:
		return a.completions()
	case epEmbeddings:
		return a.embeddings()
	case epClassify:
		return a.classify()
	case epRerank:
		return a.rerank()
	default:
		return a.responses()
	}
}

func (s *Server) injectedFailure() *apiError {
	if s.cfg.FailFirstN > 0 && s.failed.Add(1) <= int64(s.cfg.FailFirstN) {
		return errorf(http.StatusInternalServerError, "mock failure (fail-first-n)")
	}
	if s.cfg.RandomFailRate > 0 {
		s.rngMu.Lock()
		fail := s.rng.Float64() < s.cfg.RandomFailRate
		s.rngMu.Unlock()
		if fail {
			return errorf(http.StatusInternalServerError, "mock failure (random-fail-rate)")
		}
	}
	if s.cfg.StatusCode != 0 && s.cfg.StatusCode != http.StatusOK {
		return errorf(s.cfg.StatusCode, "mock failure (status-code %d)", s.cfg.StatusCode)
	}
	return nil
}

// transferKV runs the KV seam once per bootstrap entry, concurrently, and
// returns the results indexed like req.boot (nil when there is no KV).
func (s *Server) transferKV(ctx context.Context, req *request, seqs []sequence) ([]*KVResult, error) {
	if s.cfg.KV == nil || s.cfg.Role == RoleRegular || req.boot == nil {
		return nil, nil
	}
	kreqs := make([]KVRequest, len(req.boot))
	seen := make([]bool, len(req.boot))
	for _, sq := range seqs {
		e := req.entryOf(sq.genItem)
		if seen[e] {
			continue
		}
		seen[e] = true
		b := req.boot[e]
		port := b.port
		if b.portNull {
			port = s.cfg.BootstrapPort
		}
		kreqs[e] = KVRequest{Room: b.room, BootstrapHost: b.host, BootstrapPort: port,
			Prompt: sq.prompt.text, PromptTokens: len(sq.prompt.ids)}
	}
	results := make([]*KVResult, len(kreqs))
	errs := make([]error, len(kreqs))
	one := func(i int) {
		if s.cfg.Role == RolePrefill {
			results[i], errs[i] = s.cfg.KV.Prefill(ctx, kreqs[i])
		} else {
			results[i], errs[i] = s.cfg.KV.Decode(ctx, kreqs[i])
		}
		if errs[i] != nil {
			errs[i] = fmt.Errorf("room %d: %w", kreqs[i].Room, errs[i])
		}
	}
	if len(kreqs) == 1 {
		one(0)
	} else {
		var wg sync.WaitGroup
		for i := range kreqs {
			wg.Go(func() { one(i) })
		}
		wg.Wait()
	}
	return results, errors.Join(errs...)
}

func (r *request) entryOf(it *genItem) int { return min(it.entry, len(r.boot)-1) }

// sleep waits d or until ctx is done; it reports whether ctx is still live.
func sleep(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// newID returns a response id unique across workers (32 hex digits, like
// SGLang's rids).
func (s *Server) newID() string {
	return fmt.Sprintf("%s%024x", s.idPrefix, s.seq.Add(1))
}
