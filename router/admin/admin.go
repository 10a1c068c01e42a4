// Package admin is the control plane's HTTP surface: the worker API of
// both sglang-router generations, and the gate every control-plane route
// passes (authentication by cpauth, then the audit line). It sits beside
// the request path, not in it: the router hands it the routes it owns.
package admin

import (
	"context"
	"encoding/json"
	"errors"
	"net/url"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/valyala/fasthttp"

	"github.com/pdrouter/pdrouter/balancer"
	"github.com/pdrouter/pdrouter/router/cpauth"
	"github.com/pdrouter/pdrouter/router/doctor"
	"github.com/pdrouter/pdrouter/router/respond"
)

// Workers is the worker registry the API edits; *balancer.Manager is one.
type Workers interface {
	Add(balancer.WorkerSpec) (string, error)
	Await(ctx context.Context, id string) error
	List() []balancer.WorkerInfo
	Get(idOrURL string) (balancer.WorkerInfo, bool)
	Update(idOrURL string, u balancer.WorkerUpdate) (balancer.WorkerInfo, error)
	Remove(idOrURL string) (balancer.WorkerInfo, bool)
}

var _ Workers = (*balancer.Manager)(nil)

// API serves the control-plane routes. Its fields are set once, before
// the first call.
type API struct {
	Auth    *cpauth.Authenticator
	Workers Workers
	// URLs lists the registered workers' URLs (/list_workers).
	URLs func() []string
	// PD is --pd-disaggregation: a worker added without a type is refused
	// (/workers) or made a decode (/add_worker).
	PD bool
	// Base ends with the router's hard shutdown; /add_worker waits for
	// registration at most AddTimeout within it.
	Base       context.Context
	AddTimeout time.Duration
	// Doctor runs the deployment checks (GET /doctor).
	Doctor func(context.Context) []doctor.Finding
}

// Gate authenticates a control-plane call, runs handle if it is allowed,
// and writes the audit line once handle has answered. It reports whether
// handle ran.
func (a *API) Gate(ctx *fasthttp.RequestCtx, handle func(*fasthttp.RequestCtx)) bool {
	p, err := a.Auth.Check(ctx, string(ctx.Request.Header.Peek("Authorization")))
	if err == nil {
		handle(ctx)
	} else {
		deny(ctx, err)
	}
	path, _ := url.PathUnescape(string(ctx.Request.URI().PathOriginal()))
	a.Auth.Audit(p, cpauth.Call{Method: string(ctx.Method()), Path: path, Status: ctx.Response.StatusCode(),
		RequestID: string(ctx.Response.Header.Peek("x-request-id")), Allowed: err == nil})
	return err == nil
}

func deny(ctx *fasthttp.RequestCtx, err error) {
	var d *cpauth.Denied
	if !errors.As(err, &d) {
		d = &cpauth.Denied{Status: 401, Message: err.Error()}
	}
	if d.RouterKey {
		respond.Error{Status: d.Status, Code: "unauthorized", Message: d.Message}.Write(ctx)
		return
	}
	ctx.SetStatusCode(d.Status)
	if d.Status == fasthttp.StatusUnauthorized {
		ctx.Response.Header.Set("WWW-Authenticate", `Bearer realm="control-plane"`)
	}
	ctx.SetContentType("text/plain; charset=utf-8")
	ctx.SetBodyString(d.Message)
}

// ServeDoctor is GET /doctor: the findings as JSON, 200 when all are ok
// and 503 otherwise.
func (a *API) ServeDoctor(ctx *fasthttp.RequestCtx) {
	findings := a.Doctor(a.Base)
	status := 200
	if !doctor.Healthy(findings) {
		status = 503
	}
	respond.JSON(ctx, status, map[string]any{"healthy": status == 200, "findings": findings})
}

// ServeWorkers serves both generations of the worker API (spec §3.2–3.3):
// 0.3.x's /workers with UUIDs and 202, and ≤0.2.1's /add_worker,
// /remove_worker and /list_workers, which older RL stacks still call. It
// reports whether path was one of them.
func (a *API) ServeWorkers(ctx *fasthttp.RequestCtx, path, method string) bool {
	switch {
	case path == "/workers":
		a.Gate(ctx, func(ctx *fasthttp.RequestCtx) {
			switch method {
			case "GET":
				a.listWorkers(ctx)
			case "POST":
				a.addWorker(ctx)
			default:
				respond.RequireMethod(ctx, method, "GET or POST")
			}
		})
	case strings.HasPrefix(path, "/workers/"):
		a.Gate(ctx, func(ctx *fasthttp.RequestCtx) {
			// The original path: fasthttp's normalised one collapses the
			// "//" of a URL-encoded worker URL.
			raw := string(ctx.Request.URI().PathOriginal())
			a.workerByID(ctx, method, raw[strings.Index(raw, "/workers/")+len("/workers/"):])
		})
	case path == "/add_worker":
		if respond.RequireMethod(ctx, method, "POST") {
			a.Gate(ctx, a.legacyAdd)
		}
	case path == "/remove_worker":
		if respond.RequireMethod(ctx, method, "POST") {
			a.Gate(ctx, a.legacyRemove)
		}
	case path == "/list_workers":
		a.Gate(ctx, func(ctx *fasthttp.RequestCtx) {
			respond.JSON(ctx, 200, map[string]any{"urls": a.URLs()})
		})
	default:
		return false
	}
	return true
}

func (a *API) listWorkers(ctx *fasthttp.RequestCtx) {
	infos := a.Workers.List()
	stats := map[string]int{"prefill_count": 0, "decode_count": 0, "regular_count": 0}
	for _, wi := range infos {
		stats[wi.WorkerType+"_count"]++
	}
	respond.JSON(ctx, 200, map[string]any{"workers": infos, "total": len(infos), "stats": stats})
}

func (a *API) addWorker(ctx *fasthttp.RequestCtx) {
	var spec balancer.WorkerSpec
	if err := json.Unmarshal(ctx.PostBody(), &spec); err != nil {
		respond.AdminError(ctx, 400, "BAD_REQUEST", "invalid worker config: "+err.Error())
		return
	}
	if spec.WorkerType == "" && a.PD {
		respond.AdminError(ctx, 400, "BAD_REQUEST", "worker_type (prefill or decode) is required in PD mode")
		return
	}
	id, err := a.Workers.Add(spec)
	switch {
	case errors.Is(err, balancer.ErrWorkerExists):
		respond.AdminError(ctx, 409, "WORKER_EXISTS", err.Error())
		return
	case errors.Is(err, balancer.ErrTooManyPending):
		respond.AdminError(ctx, 503, "TOO_MANY_PENDING", err.Error())
		return
	case err != nil:
		respond.AdminError(ctx, 400, "BAD_REQUEST", err.Error())
		return
	}
	loc := "/workers/" + id
	ctx.Response.Header.Set("Location", loc)
	wi, _ := a.Workers.Get(id) // the URL as registered: canonical, without userinfo
	respond.JSON(ctx, 202, map[string]string{"status": "accepted", "worker_id": id, "url": wi.URL,
		"location": loc, "message": "Worker addition queued for background processing"})
}

// workerByID accepts a UUID or, like 0.2.3/0.2.4, a URL-encoded worker URL
// (slime/miles delete workers that way).
func (a *API) workerByID(ctx *fasthttp.RequestCtx, method, raw string) {
	id, err := url.PathUnescape(raw)
	if err != nil || id == "" {
		respond.AdminError(ctx, 400, "BAD_REQUEST", "Invalid worker_id "+raw)
		return
	}
	if _, uerr := uuid.Parse(id); uerr != nil && !strings.Contains(id, "://") {
		respond.AdminError(ctx, 400, "BAD_REQUEST", "Invalid worker_id "+id+": expected a UUID or a worker URL")
		return
	}
	switch method {
	case "GET":
		wi, ok := a.Workers.Get(id)
		if !ok {
			respond.AdminError(ctx, 404, "WORKER_NOT_FOUND", "Worker "+id+" not found")
			return
		}
		respond.JSON(ctx, 200, wi)
	case "PUT":
		var u balancer.WorkerUpdate
		if err := json.Unmarshal(ctx.PostBody(), &u); err != nil {
			respond.AdminError(ctx, 400, "BAD_REQUEST", "invalid worker update: "+err.Error())
			return
		}
		wi, err := a.Workers.Update(id, u)
		if err != nil {
			respond.AdminError(ctx, 404, "WORKER_NOT_FOUND", err.Error())
			return
		}
		respond.JSON(ctx, 202, map[string]any{"status": "accepted", "worker_id": wi.ID, "message": "Worker update applied", "worker": wi})
	case "DELETE":
		wi, ok := a.Workers.Remove(id)
		if !ok {
			respond.AdminError(ctx, 404, "WORKER_NOT_FOUND", "Worker "+id+" not found")
			return
		}
		respond.JSON(ctx, 202, map[string]string{"status": "accepted", "worker_id": wi.ID, "url": wi.URL,
			"message": "Worker removal queued for background processing"})
	default:
		respond.RequireMethod(ctx, method, "GET, PUT or DELETE")
	}
}

// legacyAdd is ≤0.2.1's synchronous /add_worker?url=: it answers once the
// worker is registered (or registration failed).
func (a *API) legacyAdd(ctx *fasthttp.RequestCtx) {
	args := ctx.QueryArgs()
	spec := balancer.WorkerSpec{URL: string(args.Peek("url")), APIKey: string(args.Peek("api_key")),
		WorkerType: string(args.Peek("worker_type"))}
	if spec.WorkerType == "" && a.PD {
		spec.WorkerType = balancer.Decode.String()
	}
	if p, err := args.GetUint("bootstrap_port"); err == nil {
		spec.BootstrapPort = p
	}
	id, err := a.Workers.Add(spec)
	if err == nil {
		wctx, cancel := context.WithTimeout(a.Base, a.AddTimeout)
		err = a.Workers.Await(wctx, id)
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

func (a *API) legacyRemove(ctx *fasthttp.RequestCtx) {
	u := string(ctx.QueryArgs().Peek("url"))
	ctx.SetContentType("text/plain; charset=utf-8")
	if _, ok := a.Workers.Remove(u); !ok {
		ctx.SetStatusCode(404)
		ctx.SetBodyString("Worker not found: " + u)
		return
	}
	ctx.SetBodyString("Successfully removed worker: " + u)
}
