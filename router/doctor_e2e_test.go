package router_test

import (
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os/exec"
	"strconv"
	"strings"
	"testing"

	"github.com/pdrouter/pdrouter/testkit/testenv"
)

// bootstrapStub answers SGLang's bootstrap API (GET /health, GET /route)
// as a prefill's bootstrap server does; it returns its port.
func bootstrapStub(t *testing.T) string {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/health":
			w.Write([]byte("OK"))
		case "/route":
			if r.URL.Query().Get("engine_rank") == "" {
				http.Error(w, "missing engine_rank", 400)
				return
			}
			w.Write([]byte(`{"prefill_attn_tp_size":1,"prefill_dp_size":1,"prefill_pp_size":1,"prefill_page_size":1}`))
		default:
			http.NotFound(w, r)
		}
	}))
	t.Cleanup(srv.Close)
	u, _ := url.Parse(srv.URL)
	return u.Port()
}

// doctor runs `pdrouter doctor args...` and returns its output lines and
// exit status.
func doctor(t *testing.T, args ...string) ([]string, int) {
	t.Helper()
	out, err := exec.Command(testenv.Binary(t, "pdrouter"), append([]string{"doctor"}, args...)...).CombinedOutput()
	code := 0
	var exit *exec.ExitError
	if errors.As(err, &exit) {
		code = exit.ExitCode()
	} else if err != nil {
		t.Fatal(err)
	}
	return strings.Split(strings.TrimSpace(string(out)), "\n"), code
}

// finding is the line of check on target, or "".
func finding(lines []string, check, target string) string {
	for _, l := range lines {
		f := strings.Fields(l)
		if len(f) >= 3 && f[1] == check && strings.Contains(l, target) {
			return l
		}
	}
	return ""
}

func wantFinding(t *testing.T, lines []string, verdict, check, target, detail string) {
	t.Helper()
	l := finding(lines, check, target)
	if !strings.HasPrefix(l, verdict+" ") || !strings.Contains(l, detail) {
		t.Errorf("want %s %s %s ...%s..., got %q in\n%s", verdict, check, target, detail, l, strings.Join(lines, "\n"))
	}
}

func TestDoctorHealthyDeployment(t *testing.T) {
	t.Parallel()
	port := bootstrapStub(t)
	p, d := startWorker(t, "prefill"), startWorker(t, "decode")
	args := []string{"--pd-disaggregation", "--prefill", p.URL(), port, "--decode", d.URL()}
	lines, code := doctor(t, args...)
	if code != 0 {
		t.Fatalf("exit %d:\n%s", code, strings.Join(lines, "\n"))
	}
	wantFinding(t, lines, "ok", "health", p.URL(), "reachable and healthy")
	wantFinding(t, lines, "ok", "health", d.URL(), "reachable and healthy")
	wantFinding(t, lines, "ok", "mode", p.URL(), "disaggregation_mode prefill")
	wantFinding(t, lines, "ok", "bootstrap", p.URL(), "127.0.0.1:"+port)
	wantFinding(t, lines, "ok", "model", "all workers", "every worker serves mock")
	wantFinding(t, lines, "ok", "pair", p.URL()+" -> "+d.URL(), "page_size, kv_cache_dtype, tp_size, dp_size, disaggregation_transfer_backend")
	wantFinding(t, lines, "ok", "bootstrap_host", p.URL(), "injected bootstrap_host 127.0.0.1 is loopback, and every decode runs on this host")

	// The running router answers the same on GET /doctor.
	r := startRouter(t, append(args, "--policy", "round_robin")...)
	resp, body := get(t, r.url+"/doctor")
	if resp.StatusCode != 200 || !strings.Contains(string(body), `"healthy":true`) {
		t.Fatalf("GET /doctor: %d %s", resp.StatusCode, body)
	}
}

func TestDoctorFindsEachProblem(t *testing.T) {
	t.Parallel()
	closed := strconv.Itoa(testenv.FreePort(t)) // nothing listens there
	p := startWorker(t, "prefill", "--tp-size", "2")
	d1 := startWorker(t, "decode", "--model", "other", "--page-size", "16", "--cache-dtype", "fp8_e5m2", "--transfer-backend", "nixl")
	d2 := startWorker(t, "prefill") // registered as a decode
	d3 := startWorker(t, "decode", "--health-fail-after", "1ns")
	gone := "http://127.0.0.1:" + strconv.Itoa(testenv.FreePort(t))
	lines, code := doctor(t, "--pd-disaggregation", "--prefill", p.URL(), closed,
		"--decode", d1.URL(), "--decode", d2.URL(), "--decode", d3.URL(), "--decode", gone)
	if code != 1 {
		t.Fatalf("exit %d, want 1:\n%s", code, strings.Join(lines, "\n"))
	}
	wantFinding(t, lines, "FAIL", "health", gone, "unreachable")
	wantFinding(t, lines, "FAIL", "health", d3.URL(), "unhealthy: /health answered 503")
	wantFinding(t, lines, "FAIL", "bootstrap", p.URL(), "127.0.0.1:"+closed+" unreachable")
	wantFinding(t, lines, "FAIL", "mode", d2.URL(), "disaggregation_mode is prefill, registered as decode")
	wantFinding(t, lines, "ok", "mode", d1.URL(), "disaggregation_mode decode")
	wantFinding(t, lines, "FAIL", "model", "all workers", "other on "+d1.URL())
	pair := p.URL() + " -> " + d1.URL()
	for _, diff := range []string{"page_size 1 vs 16", "kv_cache_dtype auto vs fp8_e5m2", "tp_size 2 vs 1", "disaggregation_transfer_backend mooncake vs nixl"} {
		wantFinding(t, lines, "FAIL", "pair", pair, diff)
	}
	wantFinding(t, lines, "FAIL", "pair", p.URL()+" -> "+d3.URL(), "tp_size 2 vs 1")
	if !strings.Contains(lines[len(lines)-1], "problems found") {
		t.Errorf("last line %q", lines[len(lines)-1])
	}
}

// A prefill registered by a wildcard address answers the router (a
// connection to 0.0.0.0 stays on this host), but the bootstrap_host
// injected from it is nothing a decode engine can connect to.
func TestDoctorWildcardBootstrapHost(t *testing.T) {
	t.Parallel()
	port := bootstrapStub(t)
	p, d := startWorker(t, "prefill"), startWorker(t, "decode")
	wildcard := strings.Replace(p.URL(), "127.0.0.1", "0.0.0.0", 1)
	lines, code := doctor(t, "--pd-disaggregation", "--prefill", wildcard, port, "--decode", d.URL())
	if code != 1 {
		t.Fatalf("exit %d, want 1:\n%s", code, strings.Join(lines, "\n"))
	}
	wantFinding(t, lines, "ok", "health", wildcard, "reachable and healthy")
	wantFinding(t, lines, "FAIL", "bootstrap_host", wildcard, "injected bootstrap_host 0.0.0.0 is a wildcard address")
}

// With --dp-aware each engine registers as one worker per rank; the doctor
// still checks each engine once.
func TestDoctorDPAwareChecksEnginesOnce(t *testing.T) {
	t.Parallel()
	port := bootstrapStub(t)
	p, d := startWorker(t, "prefill", "--dp-size", "2"), startWorker(t, "decode", "--dp-size", "2")
	r := startRouter(t, "--pd-disaggregation", "--dp-aware", "--policy", "round_robin", "--prefill", p.URL(), port, "--decode", d.URL())
	resp, body := get(t, r.url+"/doctor")
	var got struct {
		Healthy  bool
		Findings []struct{ Verdict, Check, Target string }
	}
	if err := json.Unmarshal(body, &got); err != nil || resp.StatusCode != 200 || !got.Healthy {
		t.Fatalf("GET /doctor: %d %s %v", resp.StatusCode, body, err)
	}
	count := map[string]int{}
	for _, f := range got.Findings {
		count[f.Check]++
	}
	if count["health"] != 2 || count["pair"] != 1 || count["bootstrap_host"] != 1 {
		t.Errorf("findings per check %v, want 2 health, 1 pair, 1 bootstrap_host:\n%s", count, body)
	}
}
