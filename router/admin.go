package router

import (
	"context"
	"encoding/json"
	"errors"
	"net/url"
	"strings"

	"github.com/google/uuid"
	"github.com/valyala/fasthttp"

	"github.com/pdrouter/pdrouter/balancer"
)

// admin serves both generations of the worker API (spec §3.2–3.3): 0.3.x's
// /workers with UUIDs and 202, and ≤0.2.1's /add_worker, /remove_worker and
// /list_workers, which older RL stacks still call. It reports whether path
// was an admin route.
func (s *Server) admin(ctx *fasthttp.RequestCtx, path, method string) bool {
	switch {
	case path == "/workers":
		s.controlPlane(ctx, func() {
			switch method {
			case "GET":
				s.listWorkers(ctx)
			case "POST":
				s.addWorker(ctx)
			default:
				s.requireMethod(ctx, method, "GET or POST")
			}
		})
	case strings.HasPrefix(path, "/workers/"):
		s.controlPlane(ctx, func() {
			// The original path: fasthttp's normalised one collapses the
			// "//" of a URL-encoded worker URL.
			raw := string(ctx.Request.URI().PathOriginal())
			s.workerByID(ctx, method, raw[strings.Index(raw, "/workers/")+len("/workers/"):])
		})
	case path == "/add_worker":
		if s.requireMethod(ctx, method, "POST") {
			s.controlPlane(ctx, func() { s.legacyAdd(ctx) })
		}
	case path == "/remove_worker":
		if s.requireMethod(ctx, method, "POST") {
			s.controlPlane(ctx, func() { s.legacyRemove(ctx) })
		}
	case path == "/list_workers":
		s.controlPlane(ctx, func() {
			urls := []string{}
			for _, w := range s.reg.Snapshot().All {
				urls = append(urls, w.URL)
			}
			writeJSON(ctx, 200, map[string]any{"urls": urls})
		})
	default:
		return false
	}
	return true
}

func (s *Server) listWorkers(ctx *fasthttp.RequestCtx) {
	infos := s.manager.List()
	stats := map[string]int{"prefill_count": 0, "decode_count": 0, "regular_count": 0}
	for _, wi := range infos {
		stats[wi.WorkerType+"_count"]++
	}
	writeJSON(ctx, 200, map[string]any{"workers": infos, "total": len(infos), "stats": stats})
}

func (s *Server) addWorker(ctx *fasthttp.RequestCtx) {
	var spec balancer.WorkerSpec
	if err := json.Unmarshal(ctx.PostBody(), &spec); err != nil {
		adminError(ctx, 400, "BAD_REQUEST", "invalid worker config: "+err.Error())
		return
	}
	if spec.WorkerType == "" && s.cfg.PDDisaggregation {
		adminError(ctx, 400, "BAD_REQUEST", "worker_type (prefill or decode) is required in PD mode")
		return
	}
	id, err := s.manager.Add(spec)
	switch {
	case errors.Is(err, balancer.ErrWorkerExists):
		adminError(ctx, 409, "WORKER_EXISTS", err.Error())
		return
	case errors.Is(err, balancer.ErrTooManyPending):
		adminError(ctx, 503, "TOO_MANY_PENDING", err.Error())
		return
	case err != nil:
		adminError(ctx, 400, "BAD_REQUEST", err.Error())
		return
	}
	loc := "/workers/" + id
	ctx.Response.Header.Set("Location", loc)
	wi, _ := s.manager.Get(id) // the URL as registered: canonical, without userinfo
	writeJSON(ctx, 202, map[string]string{"status": "accepted", "worker_id": id, "url": wi.URL,
		"location": loc, "message": "Worker addition queued for background processing"})
}

// workerByID accepts a UUID or, like 0.2.3/0.2.4, a URL-encoded worker URL
// (slime/miles delete workers that way).
func (s *Server) workerByID(ctx *fasthttp.RequestCtx, method, raw string) {
	id, err := url.PathUnescape(raw)
	if err != nil || id == "" {
		adminError(ctx, 400, "BAD_REQUEST", "Invalid worker_id "+raw)
		return
	}
	if _, uerr := uuid.Parse(id); uerr != nil && !strings.Contains(id, "://") {
		adminError(ctx, 400, "BAD_REQUEST", "Invalid worker_id "+id+": expected a UUID or a worker URL")
		return
	}
	switch method {
	case "GET":
		wi, ok := s.manager.Get(id)
		if !ok {
			adminError(ctx, 404, "WORKER_NOT_FOUND", "Worker "+id+" not found")
			return
		}
		writeJSON(ctx, 200, wi)
	case "PUT":
		var u balancer.WorkerUpdate
		if err := json.Unmarshal(ctx.PostBody(), &u); err != nil {
			adminError(ctx, 400, "BAD_REQUEST", "invalid worker update: "+err.Error())
			return
		}
		wi, err := s.manager.Update(id, u)
		if err != nil {
			adminError(ctx, 404, "WORKER_NOT_FOUND", err.Error())
			return
		}
		writeJSON(ctx, 202, map[string]any{"status": "accepted", "worker_id": wi.ID, "message": "Worker update applied", "worker": wi})
	case "DELETE":
		wi, ok := s.manager.Remove(id)
		if !ok {
			adminError(ctx, 404, "WORKER_NOT_FOUND", "Worker "+id+" not found")
			return
		}
		writeJSON(ctx, 202, map[string]string{"status": "accepted", "worker_id": wi.ID, "url": wi.URL,
			"message": "Worker removal queued for background processing"})
	default:
		s.requireMethod(ctx, method, "GET, PUT or DELETE")
	}
}

// legacyAdd is ≤0.2.1's synchronous /add_worker?url=: it answers once the
// worker is registered (or registration failed).
func (s *Server) legacyAdd(ctx *fasthttp.RequestCtx) {
	args := ctx.QueryArgs()
	spec := balancer.WorkerSpec{URL: string(args.Peek("url")), APIKey: string(args.Peek("api_key")),
		WorkerType: string(args.Peek("worker_type"))}
	if spec.WorkerType == "" && s.cfg.PDDisaggregation {
		spec.WorkerType = balancer.Decode.String()
	}
	if p, err := args.GetUint("bootstrap_port"); err == nil {
		spec.BootstrapPort = p
	}
	id, err := s.manager.Add(spec)
	if err == nil {
		wctx, cancel := context.WithTimeout(s.base, s.cfg.Manager.StartupTimeout)
		err = s.manager.Await(wctx, id)
		cancel()
	}
	ctx.SetContentType("text/plain; charset=utf-8")
	if err != nil {
		ctx.SetStatusCode(400)
		ctx.SetBodyString("Failed to add worker " + spec.URL + ": " + err.Error())
		return
	}
	ctx.SetBodyString("Successfully added worker: " + spec.URL)
}

func (s *Server) legacyRemove(ctx *fasthttp.RequestCtx) {
	u := string(ctx.QueryArgs().Peek("url"))
	ctx.SetContentType("text/plain; charset=utf-8")
	if _, ok := s.manager.Remove(u); !ok {
		ctx.SetStatusCode(404)
		ctx.SetBodyString("Worker not found: " + u)
		return
	}
	ctx.SetBodyString("Successfully removed worker: " + u)
}
