// Package info serves sglang-router 0.3.x's front endpoints that are not
// generation (spec §3.2): readiness, models, server and model info, and
// the calls fanned out to every worker (/engine_metrics, /flush_cache,
// /get_loads). It reads the registry and calls workers over a plain
// net/http client; the request path's pooled client is not involved.
package info

import (
	"bufio"
	"bytes"
	"context"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/pdrouter/pdrouter/balancer"
	"github.com/pdrouter/pdrouter/router/respond"
)

// Endpoints serves the info routes. Its fields are set once, before the
// first call.
type Endpoints struct {
	Workers *balancer.Registry
	Ready   func() bool // enough healthy workers to serve
	PD      bool        // model info comes from a prefill
	Client  *http.Client
	APIKey  string          // --api-key, sent to workers
	Base    context.Context // ends with the router's hard shutdown
}

// Readiness is /readiness: 200 once enough workers are healthy, else 503.
func (e *Endpoints) Readiness(ctx *fasthttp.RequestCtx) {
	snap := e.Workers.Snapshot()
	healthy := 0
	for _, w := range snap.All {
		if w.Healthy() {
			healthy++
		}
	}
	if !e.Ready() {
		respond.JSON(ctx, 503, map[string]any{"status": "not ready", "reason": "insufficient healthy workers"})
		return
	}
	respond.JSON(ctx, 200, map[string]any{"status": "ready", "healthy_workers": healthy, "total_workers": len(snap.All)})
}

// HealthGenerate is /health_generate: 200 while any worker is healthy.
func (e *Endpoints) HealthGenerate(ctx *fasthttp.RequestCtx) {
	if slices.ContainsFunc(e.Workers.Snapshot().All, (*balancer.Worker).Healthy) {
		ctx.SetContentType("text/plain; charset=utf-8")
		ctx.SetBodyString("At least one router has healthy workers")
		return
	}
	respond.Error{Status: 503, Code: "no_healthy_workers", Message: "No healthy workers available"}.Write(ctx)
}

// Models is /v1/models: one entry per model the workers serve.
func (e *Endpoints) Models(ctx *fasthttp.RequestCtx) {
	type model struct {
		ID      string `json:"id"`
		Object  string `json:"object"`
		OwnedBy string `json:"owned_by"`
	}
	var data []model
	seen := map[string]bool{}
	for _, w := range e.Workers.Snapshot().All {
		if !seen[w.ModelID] {
			seen[w.ModelID] = true
			data = append(data, model{w.ModelID, "model", "local"})
		}
	}
	if len(data) == 0 {
		respond.Error{Status: 503, Code: "no_models", Message: "No models available"}.Write(ctx)
		return
	}
	respond.JSON(ctx, 200, map[string]any{"object": "list", "data": data})
}

// ServerInfo keeps 0.3.x's quirk: a JSON text with a text/plain type.
func (e *Endpoints) ServerInfo(ctx *fasthttp.RequestCtx) {
	ctx.SetContentType("text/plain; charset=utf-8")
	ctx.SetBodyString(`{"router_manager":true,"routers_count":1,"workers_count":` + strconv.Itoa(len(e.Workers.Snapshot().All)) + `}`)
}

// ModelInfo proxies to the first healthy worker (regular) or the first
// prefill worker (PD).
func (e *Endpoints) ModelInfo(ctx *fasthttp.RequestCtx) {
	snap := e.Workers.Snapshot()
	t := balancer.Regular
	if e.PD {
		t = balancer.Prefill
	}
	var target *balancer.Worker
	for _, w := range snap.ByType[t] {
		if w.Healthy() {
			target = w
			break
		}
	}
	if target == nil {
		respond.NoWorkers(t.String(), len(snap.ByType[t])).Write(ctx)
		return
	}
	resp, body, err := e.get(target, "/get_model_info", 10*time.Second)
	if err != nil {
		respond.Error{Status: 502, Code: "server_error", Message: "Failed to reach worker: " + err.Error()}.Write(ctx)
		return
	}
	if resp.StatusCode/100 != 2 {
		respond.Upstream("server", resp.StatusCode, body).Write(ctx)
		return
	}
	ctx.SetContentType(resp.Header.Get("Content-Type"))
	ctx.SetBody(body)
}

// get fetches path from a worker with a timeout.
func (e *Endpoints) get(w *balancer.Worker, path string, timeout time.Duration) (*http.Response, []byte, error) {
	return e.call(http.MethodGet, w, path, timeout)
}

func (e *Endpoints) call(method string, w *balancer.Worker, path string, timeout time.Duration) (*http.Response, []byte, error) {
	ctx, cancel := context.WithTimeout(e.Base, timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, method, w.BaseURL+path, nil)
	if err != nil {
		return nil, nil, err
	}
	if e.APIKey != "" {
		req.Header.Set("Authorization", "Bearer "+e.APIKey)
	}
	resp, err := e.Client.Do(req)
	if err != nil {
		return nil, nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	return resp, body, err
}

// FanOut calls fn for every worker, at most 32 at a time.
func FanOut(workers []*balancer.Worker, fn func(i int, w *balancer.Worker)) {
	var wg sync.WaitGroup
	sem := make(chan struct{}, 32)
	for i, w := range workers {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			fn(i, w)
		})
	}
	wg.Wait()
}

// FlushCache is POST /flush_cache on every worker, with who succeeded.
func (e *Endpoints) FlushCache(ctx *fasthttp.RequestCtx) {
	workers := e.Workers.Snapshot().All
	errs := make([]string, len(workers))
	FanOut(workers, func(i int, w *balancer.Worker) {
		resp, _, err := e.call(http.MethodPost, w, "/flush_cache", 5*time.Second)
		switch {
		case err != nil:
			errs[i] = err.Error()
		case resp.StatusCode/100 != 2:
			errs[i] = "status " + strconv.Itoa(resp.StatusCode)
		}
	})
	successful := []string{}
	failed := [][2]string{}
	for i, w := range workers {
		if errs[i] == "" {
			successful = append(successful, w.URL)
		} else {
			failed = append(failed, [2]string{w.URL, errs[i]})
		}
	}
	msg := "Cache flushed on all workers"
	if len(failed) > 0 {
		msg = "Cache flush failed on " + strconv.Itoa(len(failed)) + " of " + strconv.Itoa(len(workers)) + " workers"
	}
	respond.JSON(ctx, 200, map[string]any{"successful": successful, "failed": failed,
		"total_workers": len(workers), "http_workers": len(workers), "message": msg})
}

// Loads is /get_loads: every worker's load, -1 where it could not be read.
func (e *Endpoints) Loads(ctx *fasthttp.RequestCtx) {
	workers := e.Workers.Snapshot().All
	type load struct {
		Worker     string `json:"worker"`
		WorkerType string `json:"worker_type,omitempty"`
		Load       int64  `json:"load"`
	}
	loads := make([]load, len(workers))
	ok := 0
	var mu sync.Mutex
	FanOut(workers, func(i int, w *balancer.Worker) {
		l := load{Worker: w.URL, Load: -1}
		if w.Type != balancer.Regular {
			l.WorkerType = w.Type.String()
		}
		if n, err := balancer.FetchLoad(e.Base, e.Client, w, 5*time.Second); err == nil {
			l.Load = n
			mu.Lock()
			ok++
			mu.Unlock()
		}
		loads[i] = l
	})
	respond.JSON(ctx, 200, map[string]any{"loads": loads, "total_workers": len(workers),
		"successful": ok, "failed": len(workers) - ok})
}

// EngineMetrics merges every worker's Prometheus text, labelling each
// sample with worker_addr.
func (e *Endpoints) EngineMetrics(ctx *fasthttp.RequestCtx) {
	workers := e.Workers.Snapshot().All
	bodies := make([][]byte, len(workers))
	FanOut(workers, func(i int, w *balancer.Worker) {
		if resp, body, err := e.get(w, "/metrics", 5*time.Second); err == nil && resp.StatusCode/100 == 2 {
			bodies[i] = body
		}
	})
	var out bytes.Buffer
	got := 0
	for i, b := range bodies {
		if b == nil {
			continue
		}
		got++
		addWorkerLabel(&out, b, workers[i].URL)
	}
	if got == 0 {
		respond.Error{Status: 500, Code: "engine_metrics_failed", Message: "Failed to fetch metrics from any worker"}.Write(ctx)
		return
	}
	ctx.SetContentType("text/plain; version=0.0.4")
	ctx.SetBody(out.Bytes())
}

func addWorkerLabel(out *bytes.Buffer, text []byte, worker string) {
	label := `worker_addr="` + strings.ReplaceAll(worker, `"`, `\"`) + `"`
	sc := bufio.NewScanner(bytes.NewReader(text))
	sc.Buffer(make([]byte, 64<<10), 4<<20)
	for sc.Scan() {
		line := sc.Bytes()
		if len(line) == 0 || line[0] == '#' {
			out.Write(line)
			out.WriteByte('\n')
			continue
		}
		nameEnd := bytes.IndexAny(line, "{ ")
		if nameEnd < 0 {
			continue
		}
		out.Write(line[:nameEnd])
		if line[nameEnd] == '{' {
			out.WriteString("{" + label)
			if len(line) > nameEnd+1 && line[nameEnd+1] != '}' {
				out.WriteByte(',')
			}
			out.Write(line[nameEnd+1:])
		} else {
			out.WriteString("{" + label + "}")
			out.Write(line[nameEnd:])
		}
		out.WriteByte('\n')
	}
}
