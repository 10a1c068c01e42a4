package router

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/pdrouter/pdrouter/balancer"
)

// The front endpoints of sglang-router 0.3.x (spec §3.2).

func writeJSON(ctx *fasthttp.RequestCtx, status int, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		writeError(ctx, &apiError{Status: 500, Code: "serialization_failed", Message: err.Error()})
		return
	}
	ctx.SetStatusCode(status)
	ctx.SetContentType("application/json")
	ctx.SetBody(b)
}

func (s *Server) readiness(ctx *fasthttp.RequestCtx) {
	snap := s.reg.Snapshot()
	healthy := 0
	for _, w := range snap.All {
		if w.Healthy() {
			healthy++
		}
	}
	if !s.manager.Ready() {
		writeJSON(ctx, 503, map[string]any{"status": "not ready", "reason": "insufficient healthy workers"})
		return
	}
	writeJSON(ctx, 200, map[string]any{"status": "ready", "healthy_workers": healthy, "total_workers": len(snap.All)})
}

func (s *Server) healthGenerate(ctx *fasthttp.RequestCtx) {
	if slices.ContainsFunc(s.reg.Snapshot().All, (*balancer.Worker).Healthy) {
		ctx.SetContentType("text/plain; charset=utf-8")
		ctx.SetBodyString("At least one router has healthy workers")
		return
	}
	writeError(ctx, &apiError{Status: 503, Code: "no_healthy_workers", Message: "No healthy workers available"})
}

func (s *Server) models(ctx *fasthttp.RequestCtx) {
	type model struct {
		ID      string `json:"id"`
		Object  string `json:"object"`
		OwnedBy string `json:"owned_by"`
	}
	var data []model
	seen := map[string]bool{}
	for _, w := range s.reg.Snapshot().All {
		if !seen[w.ModelID] {
			seen[w.ModelID] = true
			data = append(data, model{w.ModelID, "model", "local"})
		}
	}
	if len(data) == 0 {
		writeError(ctx, &apiError{Status: 503, Code: "no_models", Message: "No models available"})
		return
	}
	writeJSON(ctx, 200, map[string]any{"object": "list", "data": data})
}

// serverInfo keeps 0.3.x's quirk: a JSON text with a text/plain type.
func (s *Server) serverInfo(ctx *fasthttp.RequestCtx) {
	ctx.SetContentType("text/plain; charset=utf-8")
	ctx.SetBodyString(`{"router_manager":true,"routers_count":1,"workers_count":` + strconv.Itoa(len(s.reg.Snapshot().All)) + `}`)
}

// modelInfo proxies to the first healthy worker (regular) or the first
// prefill worker (PD).
func (s *Server) modelInfo(ctx *fasthttp.RequestCtx) {
	snap := s.reg.Snapshot()
	t := balancer.Regular
	if s.cfg.PDDisaggregation {
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
		writeError(ctx, selectionError(t.String(), len(snap.ByType[t])))
		return
	}
	resp, body, err := s.get(target, "/get_model_info", 10*time.Second)
	if err != nil {
		writeError(ctx, &apiError{Status: 502, Code: "server_error", Message: "Failed to reach worker: " + err.Error()})
		return
	}
	if resp.StatusCode/100 != 2 {
		writeError(ctx, upstreamError("server", resp.StatusCode, body))
		return
	}
	ctx.SetContentType(resp.Header.Get("Content-Type"))
	ctx.SetBody(body)
}

// get fetches path from a worker with a timeout.
func (s *Server) get(w *balancer.Worker, path string, timeout time.Duration) (*http.Response, []byte, error) {
	return s.call(http.MethodGet, w, path, timeout)
}

func (s *Server) call(method string, w *balancer.Worker, path string, timeout time.Duration) (*http.Response, []byte, error) {
	ctx, cancel := context.WithTimeout(s.base, timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, method, w.BaseURL+path, nil)
	if err != nil {
		return nil, nil, err
	}
	if s.cfg.APIKey != "" {
		req.Header.Set("Authorization", "Bearer "+s.cfg.APIKey)
	}
	resp, err := s.infoCalls.Do(req)
	if err != nil {
		return nil, nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	return resp, body, err
}

// fanOut calls fn for every worker, at most 32 at a time.
func fanOut(workers []*balancer.Worker, fn func(i int, w *balancer.Worker)) {
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

func (s *Server) flushCache(ctx *fasthttp.RequestCtx) {
	workers := s.reg.Snapshot().All
	errs := make([]string, len(workers))
	fanOut(workers, func(i int, w *balancer.Worker) {
		resp, _, err := s.call(http.MethodPost, w, "/flush_cache", 5*time.Second)
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
	writeJSON(ctx, 200, map[string]any{"successful": successful, "failed": failed,
		"total_workers": len(workers), "http_workers": len(workers), "message": msg})
}

func (s *Server) getLoads(ctx *fasthttp.RequestCtx) {
	workers := s.reg.Snapshot().All
	type load struct {
		Worker     string `json:"worker"`
		WorkerType string `json:"worker_type,omitempty"`
		Load       int64  `json:"load"`
	}
	loads := make([]load, len(workers))
	ok := 0
	var mu sync.Mutex
	fanOut(workers, func(i int, w *balancer.Worker) {
		l := load{Worker: w.URL, Load: -1}
		if w.Type != balancer.Regular {
			l.WorkerType = w.Type.String()
		}
		if n, err := balancer.FetchLoad(s.base, s.infoCalls, w, 5*time.Second); err == nil {
			l.Load = n
			mu.Lock()
			ok++
			mu.Unlock()
		}
		loads[i] = l
	})
	writeJSON(ctx, 200, map[string]any{"loads": loads, "total_workers": len(workers),
		"successful": ok, "failed": len(workers) - ok})
}

// engineMetrics merges every worker's Prometheus text, labelling each
// sample with worker_addr.
func (s *Server) engineMetrics(ctx *fasthttp.RequestCtx) {
	workers := s.reg.Snapshot().All
	bodies := make([][]byte, len(workers))
	fanOut(workers, func(i int, w *balancer.Worker) {
		if resp, body, err := s.get(w, "/metrics", 5*time.Second); err == nil && resp.StatusCode/100 == 2 {
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
		writeError(ctx, &apiError{Status: 500, Code: "engine_metrics_failed", Message: "Failed to fetch metrics from any worker"})
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
