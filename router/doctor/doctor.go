// Package doctor is the deployment doctor. It verifies what a PD
// deployment needs and nothing assumes: every worker answers /health;
// prefill and decode serve one model; each prefill's bootstrap server answers SGLang's bootstrap API
// (GET /health, GET /route) at the host and port the router injects; and
// every prefill/decode pair agrees, per /server_info, on what KV transfer
// needs to match (sgl-project/sglang#23342: "hangs although workers are
// healthy and the bootstrap port is reachable"); and the bootstrap_host
// injected is one the decode engines can connect to. It works over a
// worker list and a Getter, so it runs inside the router (GET /doctor) and
// from the command line (pdrouter doctor) alike.
package doctor

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

	"github.com/pdrouter/pdrouter/balancer"
	"github.com/pdrouter/pdrouter/router/info"
)

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

// timeout bounds each call the doctor makes.
const timeout = 5 * time.Second

// pairFields must be equal on a prefill and a decode for KV to move
// between them, as /server_info names them (SGLang's ServerArgs).
var pairFields = []string{"page_size", "kv_cache_dtype", "tp_size", "dp_size", "disaggregation_transfer_backend"}

// Getter fetches url with the worker's apiKey ("" = none) and returns the
// status and body; HTTPGetter is the usual one.
type Getter func(ctx context.Context, url, apiKey string) (status int, body []byte, err error)

// HTTPGetter is a Getter over c, each call bounded by the doctor's timeout
// and its body by 1 MiB.
func HTTPGetter(c *http.Client) Getter {
	return func(ctx context.Context, url, apiKey string) (int, []byte, error) {
		ctx, cancel := context.WithTimeout(ctx, timeout)
		defer cancel()
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if err != nil {
			return 0, nil, err
		}
		if apiKey != "" {
			req.Header.Set("Authorization", "Bearer "+apiKey)
		}
		resp, err := c.Do(req)
		if err != nil {
			return 0, nil, err
		}
		defer resp.Body.Close()
		body, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
		return resp.StatusCode, body, err
	}
}

// Run checks workers (Engines' list); pd adds the prefill/decode pair
// and bootstrap_host checks.
func Run(ctx context.Context, workers []*balancer.Worker, pd bool, get Getter) []Finding {
	if len(workers) == 0 {
		return []Finding{{VerdictFail, "workers", "router", "no workers configured or registered"}}
	}
	d := doctor{get: get}
	infos := make([]map[string]any, len(workers))
	perWorker := make([][]Finding, len(workers))
	info.FanOut(workers, func(i int, w *balancer.Worker) { infos[i], perWorker[i] = d.checkWorker(ctx, w) })
	var out []Finding
	for _, fs := range perWorker {
		out = append(out, fs...)
	}
	out = append(out, sameModel(workers, infos))
	if pd {
		out = append(out, pairChecks(workers, infos)...)
		out = append(out, bootstrapHostChecks(ctx, workers, systemHosts)...)
	}
	return out
}

// Engines is one worker per engine, keyed by BaseURL, from the workers
// the configuration names (a worker that never registered is the
// likeliest culprit) and any others registered since: --dp-aware
// registers an engine as one worker per rank (BASE@RANK), and the checks
// are the engine's.
func Engines(configured, registered []*balancer.Worker) []*balancer.Worker {
	byBase := map[string]*balancer.Worker{} // by BaseURL: the first rank
	var order []string
	for _, w := range registered {
		if _, ok := byBase[w.BaseURL]; !ok {
			byBase[w.BaseURL] = w
			order = append(order, w.BaseURL)
		}
	}
	var ws []*balancer.Worker
	for _, w := range configured {
		if r, ok := byBase[w.BaseURL]; ok {
			w = r
		}
		delete(byBase, w.BaseURL)
		ws = append(ws, w)
	}
	for _, u := range order {
		if w := byBase[u]; w != nil {
			ws = append(ws, w)
		}
	}
	return ws
}

type doctor struct{ get Getter }

// checkWorker checks one worker's health, server info, mode and (prefill)
// bootstrap server; it returns the server info (nil if unreadable).
func (d doctor) checkWorker(ctx context.Context, w *balancer.Worker) (map[string]any, []Finding) {
	target := w.Type.String() + " " + w.URL
	var out []Finding
	status, _, err := d.get(ctx, w.BaseURL+"/health", w.APIKey)
	switch {
	case err != nil:
		return nil, append(out, Finding{VerdictFail, "health", target, "unreachable: " + err.Error()})
	case status != 200:
		out = append(out, Finding{VerdictFail, "health", target, "unhealthy: /health answered " + strconv.Itoa(status)})
	default:
		out = append(out, Finding{VerdictOK, "health", target, "reachable and healthy"})
	}
	info, err := d.serverInfoOf(ctx, w)
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
		out = append(out, d.checkBootstrap(ctx, w, info, target))
	}
	return info, out
}

// serverInfoOf reads /server_info, or /get_server_info on older engines.
func (d doctor) serverInfoOf(ctx context.Context, w *balancer.Worker) (map[string]any, error) {
	var last string
	for _, path := range []string{"/server_info", "/get_server_info"} {
		status, body, err := d.get(ctx, w.BaseURL+path, w.APIKey)
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
func (d doctor) checkBootstrap(ctx context.Context, w *balancer.Worker, info map[string]any, target string) Finding {
	port := strconv.Itoa(w.BootstrapPort)
	if w.BootstrapPort == balancer.NoBootstrapPort {
		port = field(info, "disaggregation_bootstrap_port")
	}
	base := "http://" + net.JoinHostPort(strings.Trim(w.BootstrapHost, "[]"), port)
	for _, path := range []string{"/health", "/route?engine_rank=-1&target_dp_group=-1&target_pp_rank=-1"} {
		status, _, err := d.get(ctx, base+path, "")
		if err != nil {
			return Finding{VerdictFail, "bootstrap", target, "bootstrap server at " + base + " unreachable: " + err.Error()}
		}
		if status != 200 {
			return Finding{VerdictFail, "bootstrap", target, fmt.Sprintf("bootstrap server at %s answered %d to GET %s", base, status, path)}
		}
	}
	return Finding{VerdictOK, "bootstrap", target, "bootstrap server answers /health and /route at " + base}
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

// hostLookup is how the doctor sees hosts: what a name resolves to, and
// whether an address is this machine's own.
type hostLookup struct {
	resolve func(ctx context.Context, host string) ([]net.IP, error)
	local   func(ip net.IP) bool
}

// systemHosts resolves with the system resolver; local addresses are
// loopback and those of this machine's interfaces.
var systemHosts = hostLookup{
	resolve: func(ctx context.Context, host string) ([]net.IP, error) {
		if ip := net.ParseIP(host); ip != nil {
			return []net.IP{ip}, nil
		}
		ctx, cancel := context.WithTimeout(ctx, timeout)
		defer cancel()
		addrs, err := net.DefaultResolver.LookupIPAddr(ctx, host)
		ips := make([]net.IP, len(addrs))
		for i, a := range addrs {
			ips[i] = a.IP
		}
		return ips, err
	},
	local: func(ip net.IP) bool {
		if ip.IsLoopback() {
			return true
		}
		addrs, _ := net.InterfaceAddrs()
		for _, a := range addrs {
			if n, ok := a.(*net.IPNet); ok && n.IP.Equal(ip) {
				return true
			}
		}
		return false
	},
}

// bootstrapHostChecks is one finding per prefill on the bootstrap_host the
// router injects, which decode engines connect to (the bootstrap check
// already calls its port from here). From the router it can be verified
// that the host resolves, that it is no wildcard address, and, for a
// loopback host, that every decode runs on this machine: one elsewhere
// would connect to its own loopback. (A decode may resolve names
// differently; the router sees only its own view.)
func bootstrapHostChecks(ctx context.Context, workers []*balancer.Worker, look hostLookup) []Finding {
	var out []Finding
	seen := map[string]bool{}
	for _, p := range workers {
		if p.Type != balancer.Prefill || seen[p.BaseURL] {
			continue
		}
		seen[p.BaseURL] = true
		out = append(out, bootstrapHostCheck(ctx, p, workers, look))
	}
	return out
}

func bootstrapHostCheck(ctx context.Context, p *balancer.Worker, workers []*balancer.Worker, look hostLookup) Finding {
	target := "prefill " + p.URL
	host := strings.Trim(p.BootstrapHost, "[]")
	ips, err := look.resolve(ctx, host)
	if err != nil || len(ips) == 0 {
		return Finding{VerdictFail, "bootstrap_host", target, fmt.Sprintf("injected bootstrap_host %s does not resolve: %v", host, err)}
	}
	loopback := true
	for _, ip := range ips {
		if ip.IsUnspecified() {
			return Finding{VerdictFail, "bootstrap_host", target, "injected bootstrap_host " + host +
				" is a wildcard address, which decode engines cannot connect to: register the prefill by an address they reach"}
		}
		loopback = loopback && ip.IsLoopback()
	}
	if !loopback {
		return Finding{VerdictOK, "bootstrap_host", target, "injected bootstrap_host " + host + " resolves to " + joinIPs(ips)}
	}
	for _, d := range workers {
		if d.Type != balancer.Decode {
			continue
		}
		dhost := strings.Trim(balancer.BootstrapHost(d.BaseURL), "[]")
		dips, err := look.resolve(ctx, dhost)
		if err != nil {
			return Finding{VerdictFail, "bootstrap_host", target, fmt.Sprintf("injected bootstrap_host %s is loopback; cannot tell whether decode %s runs on this host: %v", host, d.URL, err)}
		}
		for _, ip := range dips {
			if !look.local(ip) {
				return Finding{VerdictFail, "bootstrap_host", target, "injected bootstrap_host " + host + " is loopback, but decode " + d.URL +
					" (" + ip.String() + ") runs on another host and would connect to its own: register the prefill by an address the decodes reach"}
			}
		}
	}
	return Finding{VerdictOK, "bootstrap_host", target, "injected bootstrap_host " + host + " is loopback, and every decode runs on this host"}
}

func joinIPs(ips []net.IP) string {
	s := make([]string, len(ips))
	for i, ip := range ips {
		s[i] = ip.String()
	}
	return strings.Join(s, ", ")
}
