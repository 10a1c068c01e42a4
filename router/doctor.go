package router

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/pdrouter/pdrouter/balancer"
)

// The deployment doctor verifies what a PD deployment needs and nothing
// assumes: every worker answers /health; prefill and decode serve one
// model; each prefill's bootstrap server answers SGLang's bootstrap API
// (GET /health, GET /route) at the host and port the router injects; and
// every prefill/decode pair agrees, per /server_info, on what KV transfer
// needs to match (sgl-project/sglang#23342: "hangs although workers are
// healthy and the bootstrap port is reachable").

// Verdicts of a Finding.
const (
	VerdictOK   = "ok"
	VerdictFail = "FAIL"
)

// Finding is one thing the doctor checked.
type Finding struct {
	Verdict string `json:"verdict"`
	Check   string `json:"check"`
	Target  string `json:"target"`
	Detail  string `json:"detail"`
}

func (f Finding) String() string {
	return fmt.Sprintf("%-4s %-10s %s: %s", f.Verdict, f.Check, f.Target, f.Detail)
}

// Healthy reports whether no finding failed.
func Healthy(findings []Finding) bool {
	for _, f := range findings {
		if f.Verdict != VerdictOK {
			return false
		}
	}
	return true
}

// doctorTimeout bounds each call the doctor makes.
const doctorTimeout = 5 * time.Second

// pairFields must be equal on a prefill and a decode for KV to move
// between them, as /server_info names them (SGLang's ServerArgs).
var pairFields = []string{"page_size", "kv_cache_dtype", "tp_size", "dp_size", "disaggregation_transfer_backend"}

// Doctor checks the workers the configuration names (a worker that never
// registered is the likeliest culprit) and any others registered since.
func (s *Server) Doctor(ctx context.Context) []Finding {
	workers := s.doctorWorkers()
	if len(workers) == 0 {
		return []Finding{{VerdictFail, "workers", "router", "no workers configured or registered"}}
	}
	infos := make([]map[string]any, len(workers))
	perWorker := make([][]Finding, len(workers))
	fanOut(workers, func(i int, w *balancer.Worker) { infos[i], perWorker[i] = s.checkWorker(ctx, w) })
	var out []Finding
	for _, fs := range perWorker {
		out = append(out, fs...)
	}
	out = append(out, sameModel(workers, infos))
	if s.cfg.PDDisaggregation {
		out = append(out, pairChecks(workers, infos)...)
	}
	return out
}

func (s *Server) doctorWorkers() []*balancer.Worker {
	registered := map[string]*balancer.Worker{}
	for _, w := range s.reg.Snapshot().All {
		registered[w.URL] = w
	}
	var ws []*balancer.Worker
	for _, w := range s.configuredWorkers() {
		if r, ok := registered[w.URL]; ok {
			w = r
		}
		delete(registered, w.URL)
		ws = append(ws, w)
	}
	for _, w := range s.reg.Snapshot().All {
		if registered[w.URL] != nil {
			ws = append(ws, w)
		}
	}
	return ws
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

// checkWorker checks one worker's health, server info, mode and (prefill)
// bootstrap server; it returns the server info (nil if unreadable).
func (s *Server) checkWorker(ctx context.Context, w *balancer.Worker) (map[string]any, []Finding) {
	target := w.Type.String() + " " + w.URL
	var out []Finding
	status, _, err := s.doctorGet(ctx, w.BaseURL+"/health", w.APIKey)
	switch {
	case err != nil:
		return nil, append(out, Finding{VerdictFail, "health", target, "unreachable: " + err.Error()})
	case status != 200:
		out = append(out, Finding{VerdictFail, "health", target, "unhealthy: /health answered " + strconv.Itoa(status)})
	default:
		out = append(out, Finding{VerdictOK, "health", target, "reachable and healthy"})
	}
	info, err := s.serverInfoOf(ctx, w)
	if err != nil {
		return nil, append(out, Finding{VerdictFail, "info", target, err.Error()})
	}
	want := map[balancer.WorkerType]string{balancer.Regular: "null", balancer.Prefill: "prefill", balancer.Decode: "decode"}[w.Type]
	if mode := field(info, "disaggregation_mode"); mode == want || (want == "null" && mode == "<absent>") {
		out = append(out, Finding{VerdictOK, "mode", target, "disaggregation_mode " + mode})
	} else {
		out = append(out, Finding{VerdictFail, "mode", target, "disaggregation_mode is " + mode + ", registered as " + w.Type.String()})
	}
	if w.Type == balancer.Prefill {
		out = append(out, s.checkBootstrap(ctx, w, info, target))
	}
	return info, out
}

// serverInfoOf reads /server_info, or /get_server_info on older engines.
func (s *Server) serverInfoOf(ctx context.Context, w *balancer.Worker) (map[string]any, error) {
	var last string
	for _, path := range []string{"/server_info", "/get_server_info"} {
		status, body, err := s.doctorGet(ctx, w.BaseURL+path, w.APIKey)
		if err != nil {
			return nil, fmt.Errorf("%s: %v", path, err)
		}
		if status != 200 {
			last = fmt.Sprintf("%s answered %d", path, status)
			continue
		}
		var info map[string]any
		if err := json.Unmarshal(body, &info); err != nil {
			return nil, fmt.Errorf("%s: not a JSON object: %v", path, err)
		}
		return info, nil
	}
	return nil, fmt.Errorf("no server info: %s", last)
}

// checkBootstrap calls the prefill's bootstrap server where decode will:
// the injected bootstrap_host and port (the engine's own
// disaggregation_bootstrap_port when the router injects none).
func (s *Server) checkBootstrap(ctx context.Context, w *balancer.Worker, info map[string]any, target string) Finding {
	port := strconv.Itoa(w.BootstrapPort)
	if w.BootstrapPort == balancer.NoBootstrapPort {
		port = field(info, "disaggregation_bootstrap_port")
	}
	base := "http://" + net.JoinHostPort(strings.Trim(w.BootstrapHost, "[]"), port)
	for _, path := range []string{"/health", "/route?engine_rank=-1&target_dp_group=-1&target_pp_rank=-1"} {
		status, _, err := s.doctorGet(ctx, base+path, "")
		if err != nil {
			return Finding{VerdictFail, "bootstrap", target, "bootstrap server at " + base + " unreachable: " + err.Error()}
		}
		if status != 200 {
			return Finding{VerdictFail, "bootstrap", target, fmt.Sprintf("bootstrap server at %s answered %d to GET %s", base, status, path)}
		}
	}
	return Finding{VerdictOK, "bootstrap", target, "bootstrap server answers /health and /route at " + base}
}

func (s *Server) doctorGet(ctx context.Context, url, apiKey string) (int, []byte, error) {
	ctx, cancel := context.WithTimeout(ctx, doctorTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return 0, nil, err
	}
	if apiKey != "" {
		req.Header.Set("Authorization", "Bearer "+apiKey)
	}
	resp, err := s.infoCalls.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	return resp.StatusCode, body, err
}

// field is a server-info value as text ("<absent>" when missing).
func field(info map[string]any, key string) string {
	v, ok := info[key]
	if !ok || v == nil {
		return "<absent>"
	}
	if s, ok := v.(string); ok {
		return s
	}
	b, _ := json.Marshal(v)
	return string(b)
}

func modelOf(info map[string]any) string {
	if m := field(info, "served_model_name"); m != "<absent>" {
		return m
	}
	return field(info, "model_path")
}

// sameModel is one finding: every worker whose info was read serves the
// same model.
func sameModel(workers []*balancer.Worker, infos []map[string]any) Finding {
	models := map[string][]string{}
	var order []string
	for i, info := range infos {
		if info == nil {
			continue
		}
		m := modelOf(info)
		if _, seen := models[m]; !seen {
			order = append(order, m)
		}
		models[m] = append(models[m], workers[i].URL)
	}
	switch len(order) {
	case 0:
		return Finding{VerdictFail, "model", "all workers", "no worker's server info could be read"}
	case 1:
		return Finding{VerdictOK, "model", "all workers", "every worker serves " + order[0]}
	}
	var parts []string
	for _, m := range order {
		parts = append(parts, m+" on "+strings.Join(models[m], ", "))
	}
	return Finding{VerdictFail, "model", "all workers", "workers serve different models: " + strings.Join(parts, "; ")}
}

// pairChecks compares every prefill with every decode on pairFields.
func pairChecks(workers []*balancer.Worker, infos []map[string]any) []Finding {
	var out []Finding
	for i, p := range workers {
		if p.Type != balancer.Prefill || infos[i] == nil {
			continue
		}
		for j, d := range workers {
			if d.Type != balancer.Decode || infos[j] == nil {
				continue
			}
			target := p.URL + " -> " + d.URL
			var diffs []string
			for _, k := range pairFields {
				if a, b := field(infos[i], k), field(infos[j], k); a != b {
					diffs = append(diffs, fmt.Sprintf("%s %s vs %s", k, a, b))
				}
			}
			if len(diffs) == 0 {
				out = append(out, Finding{VerdictOK, "pair", target, "agree on " + strings.Join(pairFields, ", ")})
			} else {
				out = append(out, Finding{VerdictFail, "pair", target, "KV cannot move: " + strings.Join(diffs, "; ")})
			}
		}
	}
	return out
}

// doctor serves GET /doctor: the findings as JSON, 200 when all are ok and
// 503 otherwise.
func (s *Server) doctor(ctx *fasthttp.RequestCtx) {
	findings := s.Doctor(s.base)
	status := 200
	if !Healthy(findings) {
		status = 503
	}
	writeJSON(ctx, status, map[string]any{"healthy": status == 200, "findings": findings})
}
