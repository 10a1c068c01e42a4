package bootstrap

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func do(t *testing.T, h http.Handler, method, url, body string) (int, string) {
	t.Helper()
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(method, url, strings.NewReader(body)))
	b, _ := io.ReadAll(rec.Result().Body)
	return rec.Code, strings.TrimSpace(string(b))
}

const topoURL = "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"

func TestRouteLifecycle(t *testing.T) {
	s := NewServer()
	if code, body := do(t, s, "GET", "/health", ""); code != 200 || body != "OK" {
		t.Fatalf("health %d %q", code, body)
	}
	if code, _ := do(t, s, "GET", topoURL, ""); code != http.StatusServiceUnavailable {
		t.Fatalf("topology before registration: %d", code)
	}
	// Two TP ranks: the topology stays 503 until both registered.
	reg := `{"attn_tp_size":2,"attn_tp_rank":%d,"attn_cp_size":1,"attn_dp_size":1,"pp_size":1,"system_dp_size":1,"rank_ip":"10.0.0.1","rank_port":%d,"page_size":16,"kv_cache_dtype":"bf16","load_balance_method":"follow_bootstrap_room","prefill_http_port":30000}`
	if code, _ := do(t, s, "PUT", "/route", strings.NewReplacer("%d", "0").Replace(reg)); code != 200 {
		t.Fatalf("PUT %d", code)
	}
	if code, _ := do(t, s, "GET", topoURL, ""); code != http.StatusServiceUnavailable {
		t.Fatalf("topology with 1 of 2 ranks: %d", code)
	}
	r1 := strings.Replace(strings.Replace(reg, "%d", "1", 1), "%d", "7001", 1)
	if code, _ := do(t, s, "PUT", "/route", r1); code != 200 {
		t.Fatalf("PUT %d", code)
	}
	code, body := do(t, s, "GET", topoURL, "")
	if code != 200 || !strings.Contains(body, `"attn_tp_size":2`) || !strings.Contains(body, `"follow_bootstrap_room":true`) || !strings.Contains(body, `"page_size":16`) {
		t.Fatalf("topology %d %s", code, body)
	}
	code, body = do(t, s, "GET", "/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=1&target_pp_rank=0", "")
	if code != 200 || body != `{"rank_ip":"10.0.0.1","rank_port":7001}` {
		t.Fatalf("rank %d %s", code, body)
	}
	// Older SGLang: no cp rank.
	if code, _ := do(t, s, "GET", "/route?prefill_dp_rank=0&target_tp_rank=1&target_pp_rank=0", ""); code != 200 {
		t.Fatalf("rank without cp: %d", code)
	}
	if code, _ := do(t, s, "GET", "/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=5&target_pp_rank=0", ""); code != 404 {
		t.Fatalf("unknown rank: %d", code)
	}
	if code, _ := do(t, s, "GET", "/route?prefill_dp_rank=x", ""); code != 400 {
		t.Fatalf("bad rank: %d", code)
	}
	if code, _ := do(t, s, "PUT", "/route", "{"); code != 400 {
		t.Fatalf("bad PUT: %d", code)
	}
}

func TestDPRanksExpire(t *testing.T) {
	s := NewServer()
	now := time.Unix(1000, 0)
	s.now = func() time.Time { return now }
	if code, _ := do(t, s, "POST", "/register_dp_rank", `{"bootstrap_room":9223372036854775807,"dp_rank":3}`); code != 200 {
		t.Fatal(code)
	}
	_, body := do(t, s, "POST", "/query_dp_ranks", `{"bootstrap_rooms":[9223372036854775807,5]}`)
	if body != `{"9223372036854775807":3}` {
		t.Fatalf("query %s", body)
	}
	now = now.Add(121 * time.Second)
	if _, body := do(t, s, "POST", "/query_dp_ranks", `{"bootstrap_rooms":[9223372036854775807]}`); body != `{}` {
		t.Fatalf("after TTL %s", body)
	}
}

func TestResolverWaitsForRegistration(t *testing.T) {
	s := NewServer()
	ts := httptest.NewServer(s)
	defer ts.Close()
	go func() {
		time.Sleep(50 * time.Millisecond)
		s.Register(RankInfo{RankIP: "127.0.0.1", RankPort: 4242, PageSize: 16, KVCacheDtype: "bf16"})
	}()
	r := NewResolver(16, "bf16")
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	addr, err := r.Resolve(ctx, strings.TrimPrefix(ts.URL, "http://"))
	if err != nil || addr != "127.0.0.1:4242" {
		t.Fatalf("%q %v", addr, err)
	}
	bad := NewResolver(32, "bf16")
	if _, err := bad.Resolve(ctx, strings.TrimPrefix(ts.URL, "http://")); err == nil || !strings.Contains(err.Error(), "page size") {
		t.Fatalf("page size mismatch: %v", err)
	}
	ts.CloseClientConnections()
	r.Client.CloseIdleConnections()
	bad.Client.CloseIdleConnections()
}
