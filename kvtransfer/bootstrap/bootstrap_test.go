package bootstrap

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

type answer struct {
	code  int
	body  string
	ctype string
}

func do(t *testing.T, h http.Handler, method, url, body string) answer {
	t.Helper()
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(method, url, strings.NewReader(body)))
	b, _ := io.ReadAll(rec.Result().Body)
	return answer{rec.Code, string(b), rec.Header().Get("Content-Type")}
}

const (
	topoURL = "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
	textCT  = "text/plain; charset=utf-8"
	jsonCT  = "application/json; charset=utf-8"
)

// sglangPut is the body SGLang 0.5.23's CommonKVManager.register_to_bootstrap
// sends (requests' json=, i.e. json.dumps), for TP rank tp of tpSize.
func sglangPut(tpSize, tpRank, port int) string {
	return fmt.Sprintf(`{"attn_tp_size": %d, "attn_tp_rank": %d, "attn_cp_size": 1, "attn_cp_rank": 0, "attn_dp_size": 1, "attn_dp_rank": 0, `+
		`"pp_size": 1, "pp_rank": 0, "system_dp_size": 1, "system_dp_rank": 0, "rank_ip": "127.0.0.1", "rank_port": %d, `+
		`"page_size": 16, "kv_cache_dtype": "bfloat16", "kv_layout": null, "dsv41_spec_layout": null, "load_balance_method": "round_robin", `+
		`"enable_dsa_cache_layer_split": false, "enable_kv_cache_sharding": false, "prefill_http_port": 30000, "decode_allocation_policy": "early"}`,
		tpSize, tpRank, port)
}

// sglangTopology is what CommonKVBootstrapServer answers the topology query
// with after sglangPut registrations: dataclasses.asdict(PrefillServerInfo)
// through web.json_response, kv_layout and dsv41_spec_layout left out as None.
func sglangTopology(tpSize int) string {
	return fmt.Sprintf(`{"attn_tp_size": %d, "attn_cp_size": 1, "dp_size": 1, "pp_size": 1, "page_size": 16, "kv_cache_dtype": "bfloat16", `+
		`"follow_bootstrap_room": false, "enable_dsa_cache_layer_split": false, "decode_allocation_policy": "early", "enable_kv_cache_sharding": false, `+
		`"prefill_http_port": 30000, "target_tp_rank": null, "target_tp_ranks": null, "target_cp_ranks": null, "target_pp_ranks": null, `+
		`"required_dst_info_num": null, "required_prefill_response_num": null}`, tpSize)
}

func expect(t *testing.T, what string, got, want answer) {
	t.Helper()
	if got != want {
		t.Fatalf("%s:\n got %d %q %s\nwant %d %q %s", what, got.code, got.ctype, got.body, want.code, want.ctype, want.body)
	}
}

// TestSGLangExchange replays what SGLang's prefill and decode send and
// checks the answers are the ones SGLang's own server gives.
func TestSGLangExchange(t *testing.T) {
	s := NewServer()
	expect(t, "health", do(t, s, "GET", "/health", ""), answer{200, "OK", textCT})
	notReady := func(n int) answer {
		return answer{503, fmt.Sprintf("Prefill server not fully registered yet (%d workers registered).", n), textCT}
	}
	expect(t, "topology before registration", do(t, s, "GET", topoURL, ""), notReady(0))
	rank0 := "/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0"
	expect(t, "rank before registration", do(t, s, "GET", rank0, ""), notReady(0))
	// Two TP ranks: not ready until both registered.
	expect(t, "PUT rank 0", do(t, s, "PUT", "/route", sglangPut(2, 0, 41235)), answer{200, "OK", textCT})
	expect(t, "topology with 1 of 2", do(t, s, "GET", topoURL, ""), notReady(1))
	expect(t, "PUT rank 1", do(t, s, "PUT", "/route", sglangPut(2, 1, 41236)), answer{200, "OK", textCT})
	expect(t, "topology", do(t, s, "GET", topoURL, ""), answer{200, sglangTopology(2), jsonCT})
	expect(t, "rank 0", do(t, s, "GET", rank0, ""), answer{200, `{"rank_ip": "127.0.0.1", "rank_port": 41235}`, jsonCT})
	expect(t, "rank 1", do(t, s, "GET", "/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=1&target_pp_rank=0", ""),
		answer{200, `{"rank_ip": "127.0.0.1", "rank_port": 41236}`, jsonCT})
	expect(t, "unknown rank", do(t, s, "GET", "/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=5&target_pp_rank=0", ""),
		answer{404, "Bootstrap info not found for dp_rank=0 cp_rank=0 tp_rank=5 pp_rank=0", textCT})
	missing := answer{400, "Missing inputs for bootstrap server.", textCT}
	expect(t, "no cp rank", do(t, s, "GET", "/route?prefill_dp_rank=0&target_tp_rank=1&target_pp_rank=0", ""), missing)
	expect(t, "empty rank", do(t, s, "GET", "/route?prefill_dp_rank=&prefill_cp_rank=0&target_tp_rank=1&target_pp_rank=0", ""), missing)
	if a := do(t, s, "GET", "/route?prefill_dp_rank=x&prefill_cp_rank=0&target_tp_rank=1&target_pp_rank=0", ""); a.code != 500 {
		t.Fatalf("rank that is not a number: %+v, want 500 as int() raises", a)
	}
	expect(t, "POST /route", do(t, s, "POST", "/route", "{}"), answer{405, "Method not allowed", "application/json"})
	// Later registrations do not change the topology the first one set...
	later := strings.Replace(sglangPut(2, 1, 41237), `"page_size": 16`, `"page_size": 32`, 1)
	expect(t, "re-register", do(t, s, "PUT", "/route", later), answer{200, "OK", textCT})
	expect(t, "topology after re-register", do(t, s, "GET", topoURL, ""), answer{200, sglangTopology(2), jsonCT})
	// ... but they must agree on the allocation policy.
	lazy := strings.Replace(sglangPut(2, 1, 41237), `"early"`, `"lazy"`, 1)
	expect(t, "other policy", do(t, s, "PUT", "/route", lazy), answer{400, "Inconsistent prefill allocation policies", textCT})
	spec := strings.Replace(sglangPut(2, 1, 41237), `"dsv41_spec_layout": null`, `"dsv41_spec_layout": {"a": 1}`, 1)
	expect(t, "other dsv41 layout", do(t, s, "PUT", "/route", spec), answer{400, "DeepSeek-V4.1 DSpark PD layout differs across prefill ranks", textCT})
	for name, b := range map[string]string{
		"missing key":  strings.Replace(sglangPut(1, 0, 1), `"pp_rank": 0, `, "", 1),
		"not JSON":     "{",
		"null page":    strings.Replace(sglangPut(1, 0, 1), `"page_size": 16`, `"page_size": null`, 1),
		"not a number": strings.Replace(sglangPut(1, 0, 1), `"rank_port": 1`, `"rank_port": "x"`, 1),
	} {
		if a := do(t, s, "PUT", "/route", b); a.code != 500 {
			t.Errorf("PUT with %s: %+v, want 500", name, a)
		}
	}
	expect(t, "unknown path", do(t, s, "GET", "/nope", ""), answer{404, "404: Not Found", textCT})
	if a := do(t, s, "GET", "/register_dp_rank", ""); a.code != 405 {
		t.Fatalf("GET /register_dp_rank: %+v", a)
	}
}

// TestOptionalFields: fields SGLang reads with .get() default as it does,
// and set ones come back in the topology.
func TestOptionalFields(t *testing.T) {
	s := NewServer()
	minimal := `{"attn_tp_size": 1, "attn_tp_rank": 0, "attn_cp_size": 1, "attn_cp_rank": 0, "attn_dp_size": 1, "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0, "system_dp_size": 1, "system_dp_rank": 0, "rank_ip": "10.0.0.1", "rank_port": "7000", "page_size": 64, "kv_cache_dtype": null}`
	expect(t, "PUT", do(t, s, "PUT", "/route", minimal), answer{200, "OK", textCT})
	want := `{"attn_tp_size": 1, "attn_cp_size": 1, "dp_size": 1, "pp_size": 1, "page_size": 64, "kv_cache_dtype": null, "follow_bootstrap_room": true, ` +
		`"enable_dsa_cache_layer_split": false, "decode_allocation_policy": "early", "enable_kv_cache_sharding": false, "prefill_http_port": null, ` +
		`"target_tp_rank": null, "target_tp_ranks": null, "target_cp_ranks": null, "target_pp_ranks": null, "required_dst_info_num": null, "required_prefill_response_num": null}`
	expect(t, "topology", do(t, s, "GET", topoURL, ""), answer{200, want, jsonCT})
	expect(t, "rank", do(t, s, "GET", "/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0", ""),
		answer{200, `{"rank_ip": "10.0.0.1", "rank_port": 7000}`, jsonCT})

	s = NewServer()
	dp := strings.NewReplacer(`"system_dp_size": 1, "system_dp_rank": 0`, `"system_dp_size": 2, "system_dp_rank": 1`,
		`"kv_cache_dtype": null`, `"kv_cache_dtype": "fp8_e4m3", "kv_layout": "NHD", "dsv41_spec_layout": {"k": [1, 2]}, "enable_dsa_cache_layer_split": 1`).Replace(minimal)
	expect(t, "PUT dp rank 1", do(t, s, "PUT", "/route", dp), answer{200, "OK", textCT})
	expect(t, "1 of 2 DP ranks", do(t, s, "GET", topoURL, ""), answer{503, "Prefill server not fully registered yet (1 workers registered).", textCT})
	expect(t, "PUT dp rank 0", do(t, s, "PUT", "/route", strings.Replace(dp, `"system_dp_rank": 1`, `"system_dp_rank": 0`, 1)), answer{200, "OK", textCT})
	a := do(t, s, "GET", topoURL, "")
	// Nested values are written compactly (json.dumps would space them): same JSON.
	for _, part := range []string{`"dp_size": 2`, `"kv_cache_dtype": "fp8_e4m3"`, `"enable_dsa_cache_layer_split": true, "dsv41_spec_layout": {"k":[1,2]}, "kv_layout": "NHD", "decode_allocation_policy"`} {
		if a.code != 200 || !strings.Contains(a.body, part) {
			t.Fatalf("topology %+v lacks %s", a, part)
		}
	}
	expect(t, "dp rank 1", do(t, s, "GET", "/route?prefill_dp_rank=1&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0", ""),
		answer{200, `{"rank_ip": "10.0.0.1", "rank_port": 7000}`, jsonCT})
}

func TestDPRanksExpire(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s := NewServer()
		expect(t, "register", do(t, s, "POST", "/register_dp_rank", `{"bootstrap_room": 9223372036854775807, "dp_rank": 3}`), answer{200, "OK", textCT})
		expect(t, "register by string", do(t, s, "POST", "/register_dp_rank", `{"bootstrap_room": "12", "dp_rank": 0}`), answer{200, "OK", textCT})
		expect(t, "query", do(t, s, "POST", "/query_dp_ranks", `{"bootstrap_rooms": [9223372036854775807, 5, "12"]}`),
			answer{200, `{"9223372036854775807": 3, "12": 0}`, jsonCT})
		if a := do(t, s, "POST", "/register_dp_rank", `{"dp_rank": 3}`); a.code != 500 {
			t.Fatalf("register without a room: %+v", a)
		}
		time.Sleep(119 * time.Second)
		expect(t, "within the TTL", do(t, s, "POST", "/query_dp_ranks", `{"bootstrap_rooms": ["12"]}`), answer{200, `{"12": 0}`, jsonCT})
		time.Sleep(2 * time.Second)
		expect(t, "after TTL", do(t, s, "POST", "/query_dp_ranks", `{"bootstrap_rooms": [9223372036854775807]}`), answer{200, `{}`, jsonCT})
	})
}

// TestKvproxyRegistration: the kvproxy's own registration (pool mode) gives
// the topology its resolver and SGLang's decode read.
func TestKvproxyRegistration(t *testing.T) {
	s := NewServer()
	ts := httptest.NewServer(s)
	defer ts.Close()
	go func() {
		time.Sleep(50 * time.Millisecond)
		_ = s.Register(RankInfo{AttnTPSize: 1, AttnCPSize: 1, AttnDPSize: 1, PPSize: 1, SystemDPSize: 1,
			RankIP: "127.0.0.1", RankPort: 4242, PageSize: 16, KVCacheDtype: "bf16", LoadBalanceMethod: "follow_bootstrap_room"})
	}()
	r := NewResolver(16, "bf16")
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	addr, err := r.Resolve(ctx, strings.TrimPrefix(ts.URL, "http://"))
	if err != nil || addr != "127.0.0.1:4242" {
		t.Fatalf("%q %v", addr, err)
	}
	a := do(t, s, "GET", topoURL, "")
	if !strings.Contains(a.body, `"follow_bootstrap_room": true`) || !strings.Contains(a.body, `"prefill_http_port": null`) {
		t.Fatalf("topology %s", a.body)
	}
	bad := NewResolver(32, "bf16")
	if _, err := bad.Resolve(ctx, strings.TrimPrefix(ts.URL, "http://")); err == nil || !strings.Contains(err.Error(), "page size") {
		t.Fatalf("page size mismatch: %v", err)
	}
	if err := s.Register(RankInfo{AttnTPSize: 1}); err != nil {
		t.Fatalf("a second registration: %v", err)
	}
	ts.CloseClientConnections()
	r.Client.CloseIdleConnections()
	bad.Client.CloseIdleConnections()
}

// TestQueryDPRanksRepeatedRoom: SGLang builds the answer as a dict keyed by
// str(int(room)), so a room asked for twice (or as 5 and "5") is one key.
func TestQueryDPRanksRepeatedRoom(t *testing.T) {
	s := NewServer()
	expect(t, "register", do(t, s, "POST", "/register_dp_rank", `{"bootstrap_room": 5, "dp_rank": 1}`), answer{200, "OK", textCT})
	expect(t, "register 6", do(t, s, "POST", "/register_dp_rank", `{"bootstrap_room": 6, "dp_rank": 2}`), answer{200, "OK", textCT})
	expect(t, "query", do(t, s, "POST", "/query_dp_ranks", `{"bootstrap_rooms": [5, 6, "5", 5.0, 6]}`),
		answer{200, `{"5": 1, "6": 2}`, jsonCT})
}

// TestTrailingDataIsNotJSON: aiohttp's request.json() is json.loads of the
// whole body, which rejects anything but whitespace after the object.
func TestTrailingDataIsNotJSON(t *testing.T) {
	s := NewServer()
	if a := do(t, s, "POST", "/register_dp_rank", `{"bootstrap_room": 5, "dp_rank": 1} {"x": 1}`); a.code != 500 {
		t.Fatalf("a body with a second value: %+v", a)
	}
	if a := do(t, s, "PUT", "/route", sglangPut(1, 0, 7000)+`garbage`); a.code != 500 {
		t.Fatalf("a registration with trailing bytes: %+v", a)
	}
	expect(t, "nothing was recorded", do(t, s, "POST", "/query_dp_ranks", `{"bootstrap_rooms": [5]}`+"\n\t "), answer{200, `{}`, jsonCT})
	if a := do(t, s, "GET", topoURL, ""); a.code != 503 {
		t.Fatalf("topology after a rejected registration: %+v", a)
	}
}

// TestRouteGarbageRanks: GET /route answers bad rank values as SGLang's
// _handle_route_get does. It reads the ranks lazily: the all -1 check stops
// at the first rank that is not -1, an unready server answers 503 before the
// rest are parsed, and the table lookup parses rank by rank, so a rank
// missing from the table (404) hides garbage after it; only garbage that
// int() reaches raises (500). A number too big for int64 is a valid int
// that no rank has.
func TestRouteGarbageRanks(t *testing.T) {
	route := func(dp, cp, tp, pp string) string {
		q := url.Values{"prefill_dp_rank": {dp}, "prefill_cp_rank": {cp}, "target_tp_rank": {tp}, "target_pp_rank": {pp}}
		return "/route?" + q.Encode()
	}
	notFound := func(dp, cp, tp, pp string) answer {
		return answer{404, fmt.Sprintf("Bootstrap info not found for dp_rank=%s cp_rank=%s tp_rank=%s pp_rank=%s", dp, cp, tp, pp), textCT}
	}
	s := NewServer()
	notReady := answer{503, "Prefill server not fully registered yet (0 workers registered).", textCT}
	for _, q := range [][4]string{{"0", "x", "0", "0"}, {"-1", "0", "x", "x"}, {"-1", "-1", "-1", "0"}, {"5", "0", "0", "y"}} {
		expect(t, "unready "+q[0]+","+q[1]+","+q[2]+","+q[3], do(t, s, "GET", route(q[0], q[1], q[2], q[3]), ""), notReady)
	}
	for _, q := range [][4]string{{"x", "0", "0", "0"}, {"-1", "x", "0", "0"}, {"-1", "-1", "-1", "x"}} {
		if a := do(t, s, "GET", route(q[0], q[1], q[2], q[3]), ""); a.code != 500 {
			t.Errorf("unready %v: %+v, want 500 (int() raises before the readiness check)", q, a)
		}
	}
	expect(t, "PUT", do(t, s, "PUT", "/route", sglangPut(1, 0, 7000)), answer{200, "OK", textCT})
	for _, q := range [][4]string{
		{"7", "x", "x", "x"},                     // no dp group 7: KeyError before int("x")
		{"-1", "0", "x", "0"},                    // not the all -1 query; dp -1 is no group
		{"0", "3", "x", "0"},                     // no cp rank 3 in dp 0
		{"0", "0", "0", "1"},                     // no pp rank 1
		{"99999999999999999999", "0", "0", "0"},  // a valid int, no such group
		{"0", "0", "-99999999999999999999", "x"}, // idem for tp, before pp's garbage
		{" 0", "0", "0", "+1"},                   // int() takes spaces and a sign
	} {
		expect(t, fmt.Sprint(q), do(t, s, "GET", route(q[0], q[1], q[2], q[3]), ""), notFound(q[0], q[1], q[2], q[3]))
	}
	for _, q := range [][4]string{{"0", "x", "0", "0"}, {"0", "0", "0", "1.5"}, {"x", "0", "0", "0"}} {
		if a := do(t, s, "GET", route(q[0], q[1], q[2], q[3]), ""); a.code != 500 {
			t.Errorf("ready %v: %+v, want 500 (int() raises on a rank the lookup reaches)", q, a)
		}
	}
	expect(t, "rank 0 with spaces", do(t, s, "GET", route("0", " 0", "0 ", "+0"), ""), answer{200, `{"rank_ip": "127.0.0.1", "rank_port": 7000}`, jsonCT})
}
