package mockworker

import (
	"bytes"
	"context"
	"encoding/json"
	"net"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

const vllmAsk = `"kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}`

// vllmPrefill sends a prefill-leg request and returns its kv_transfer_params.
func vllmPrefill(t *testing.T, p *harness, prompt, xid string) json.RawMessage {
	t.Helper()
	status, _, body := p.post("/v1/completions", `{"model":"mock","prompt":"`+prompt+`","max_tokens":1,"stream":false,`+vllmAsk+`}`, "X-Request-Id", xid)
	if status != 200 {
		t.Fatalf("prefill: %d %s", status, body)
	}
	var out struct {
		Params  json.RawMessage `json:"kv_transfer_params"`
		Choices []struct {
			Text string `json:"text"`
		} `json:"choices"`
	}
	if err := json.Unmarshal(body, &out); err != nil || len(out.Choices) != 1 || strings.Count(out.Choices[0].Text, "tok") != 1 {
		t.Fatalf("prefill reply (one token, max_tokens 1): %v %s", err, body)
	}
	return out.Params
}

func TestVLLMPrefillHandsItsKVToOneDecode(t *testing.T) {
	p := start(t, Config{Role: RoleVLLMPrefill, Engine: EngineInfo{TPSize: 2}})
	d := start(t, Config{Role: RoleVLLMDecode, Tokens: 3})
	params := vllmPrefill(t, p, strings.Repeat("w ", 20), "rid-1")
	var got map[string]any
	if err := json.Unmarshal(params, &got); err != nil {
		t.Fatalf("params %s: %v", params, err)
	}
	host, port, _ := strings.Cut(p.s.Addr(), ":")
	for k, want := range map[string]any{"do_remote_prefill": true, "do_remote_decode": false, "remote_host": host,
		"tp_size": 2.0, "remote_engine_id": "mock-engine-" + p.s.idPrefix} {
		if got[k] != want {
			t.Errorf("%s = %v, want %v", k, got[k], want)
		}
	}
	if blocks, _ := got["remote_block_ids"].([]any); len(blocks) != 2 { // 21 tokens: two blocks of 16
		t.Errorf("remote_block_ids %v, want 2", got["remote_block_ids"])
	}
	if got["remote_port"] != json.Number(port) && got["remote_port"] != mustFloat(port) {
		t.Errorf("remote_port %v, want %s", got["remote_port"], port)
	}
	if held := p.s.VLLMHeldKV(); len(held) != 1 || held[0].XRequestID != "rid-1" {
		t.Fatalf("held %+v", held)
	}

	req := `{"model":"mock","prompt":"` + strings.Repeat("w ", 20) + `","kv_transfer_params":` + string(params) + `}`
	if status, _, body := d.post("/v1/completions", req, "X-Request-Id", "rid-1"); status != 200 {
		t.Fatalf("decode: %d %s", status, body)
	}
	if held := p.s.VLLMHeldKV(); len(held) != 0 {
		t.Errorf("a pulled request's blocks are still held: %+v", held)
	}
	if pulls := d.s.VLLMPulls(); len(pulls) != 1 || pulls[0].Error != "" || pulls[0].XRequestID != "rid-1" {
		t.Errorf("pulls %+v", pulls)
	}
	// The KV went to one decode: a second pull of it is refused.
	if status, _, body := d.post("/v1/completions", req, "X-Request-Id", "rid-1"); status != 500 || !strings.Contains(string(body), "no KV held") {
		t.Errorf("second decode of the same KV: %d %s", status, body)
	}
}

func mustFloat(s string) float64 {
	var f float64
	_ = json.Unmarshal([]byte(s), &f)
	return f
}

func TestVLLMDecodeRefusesParamsNamingNoReachablePrefill(t *testing.T) {
	p := start(t, Config{Role: RoleVLLMPrefill})
	d := start(t, Config{Role: RoleVLLMDecode})
	params := vllmPrefill(t, p, "a b c", "rid-2")
	var good map[string]any
	_ = json.Unmarshal(params, &good)
	with := func(k string, v any) string {
		m := map[string]any{}
		for k, v := range good {
			m[k] = v
		}
		if v == nil {
			delete(m, k)
		} else {
			m[k] = v
		}
		b, _ := json.Marshal(m)
		return string(b)
	}
	for _, c := range []struct {
		name, params, xid string
		status            int
		want              string
	}{
		{"none", `null`, "rid-2", 400, "no kv_transfer_params"},
		{"prefill's own ask", `{"do_remote_decode":true}`, "rid-2", 400, "do_remote_prefill"},
		{"no engine", with("remote_engine_id", nil), "rid-2", 400, "remote_engine_id"},
		{"no blocks", with("remote_block_ids", nil), "rid-2", 400, "remote_block_ids"},
		{"bad port", with("remote_port", "x"), "rid-2", 400, "remote_port"},
		{"no tp_size", with("tp_size", nil), "rid-2", 400, "tp_size"},
		{"unreachable", with("remote_port", 1), "rid-2", 500, "unreachable"},
		{"other engine", with("remote_engine_id", "other"), "rid-2", 500, "engine"},
		{"other blocks", with("remote_block_ids", []int{99}), "rid-2", 500, "blocks"},
		{"other request id", good2(with), "rid-2", 500, "no KV held"},
		{"other X-Request-Id", string(params), "rid-x", 500, "X-Request-Id"},
	} {
		status, _, body := d.post("/v1/chat/completions", `{"messages":[{"role":"user","content":"a b c"}],"kv_transfer_params":`+c.params+`}`, "X-Request-Id", c.xid)
		if status != c.status || !strings.Contains(string(body), c.want) {
			t.Errorf("%s: %d %s, want %d naming %q", c.name, status, body, c.status, c.want)
		}
	}
	// Nothing above pulled the KV: the prefill still holds it; KV of
	// another prompt is refused and frees it.
	if held := p.s.VLLMHeldKV(); len(held) != 1 {
		t.Fatalf("held %+v", held)
	}
	status, _, body := d.post("/v1/completions", `{"prompt":"x y z","kv_transfer_params":`+string(params)+`}`, "X-Request-Id", "rid-2")
	if status != 500 || !strings.Contains(string(body), "another prompt") {
		t.Errorf("another prompt's KV: %d %s", status, body)
	}
	if n := len(d.s.VLLMPulls()); n != 12 {
		t.Errorf("%d pulls recorded, want 12", n)
	}
}

func good2(with func(string, any) string) string { return with("remote_request_id", "cmpl-other") }

func TestVLLMPrefillFreesUnclaimedKVAfterTheTimeout(t *testing.T) {
	p := start(t, Config{Role: RoleVLLMPrefill, VLLMKVTimeout: 50 * time.Millisecond})
	vllmPrefill(t, p, "a", "rid-3")
	deadline := time.Now().Add(5 * time.Second)
	for len(p.s.VLLMHeldKV()) != 0 {
		if time.Now().After(deadline) {
			t.Fatal("KV still held after the timeout")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestVLLMRolesServeNoSGLangEndpoints(t *testing.T) {
	for _, role := range []Role{RoleVLLMPrefill, RoleVLLMDecode} {
		h := start(t, Config{Role: role})
		for _, path := range []string{"/get_server_info", "/server_info", "/get_load", "/v1/loads", "/get_model_info", "/health_generate"} {
			if status, _ := h.get(path); status != http.StatusNotFound {
				t.Errorf("%s GET %s: %d, want 404", role, path, status)
			}
		}
		if status, _, _ := h.post("/generate", `{"text":"a"}`); status != http.StatusNotFound {
			t.Errorf("%s POST /generate: %d, want 404", role, status)
		}
		if status, _ := h.get("/health"); status != 200 {
			t.Errorf("%s /health: %d", role, status)
		}
	}
	// A prefill asked for no remote decode is a plain vLLM server: no
	// params, no KV held, max_tokens honoured.
	h := start(t, Config{Role: RoleVLLMPrefill, Tokens: 5})
	status, _, body := h.post("/v1/completions", `{"prompt":"a","max_tokens":3}`)
	if status != 200 || strings.Contains(string(body), "kv_transfer_params") || !strings.Contains(string(body), `"completion_tokens":3`) {
		t.Errorf("plain request: %d %s", status, body)
	}
	if len(h.s.VLLMHeldKV()) != 0 {
		t.Error("KV held for a request that asked for none")
	}
}

// The decode keeps its last RecordLimit pulls, and Reset clears them.
func TestVLLMPullsAreBounded(t *testing.T) {
	d := start(t, Config{Role: RoleVLLMDecode, RecordLimit: 2})
	for _, xid := range []string{"a", "b", "c"} {
		d.post("/v1/completions", `{"prompt":"a","kv_transfer_params":null}`, "X-Request-Id", xid)
	}
	if pulls := d.s.VLLMPulls(); len(pulls) != 2 || pulls[0].XRequestID != "b" || pulls[1].XRequestID != "c" {
		t.Errorf("pulls %+v, want b and c", pulls)
	}
	d.s.Reset()
	if n := len(d.s.VLLMPulls()); n != 0 {
		t.Errorf("%d pulls after Reset", n)
	}
}

// roomKV is an in-process KV plane: a prefill's room waits until a decode
// takes it (or its ctx ends); a decode finds it by room and checks the
// prompt.
type roomKV struct {
	mu      sync.Mutex
	rooms   map[uint64]*testRoom
	decodes []KVRequest
	ended   chan error // a prefill transfer's end without a decode
}

type testRoom struct {
	prompt chan []byte
	taken  chan struct{}
}

func newRoomKV() *roomKV { return &roomKV{rooms: map[uint64]*testRoom{}, ended: make(chan error, 8)} }

func (k *roomKV) room(id uint64) *testRoom {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.rooms[id] == nil {
		k.rooms[id] = &testRoom{prompt: make(chan []byte, 1), taken: make(chan struct{})}
	}
	return k.rooms[id]
}

func (k *roomKV) Prefill(ctx context.Context, r KVRequest) (*KVResult, error) {
	room := k.room(r.Room)
	room.prompt <- append([]byte(nil), r.Prompt...)
	select {
	case <-room.taken:
		return &KVResult{Transport: "test", ChecksumOK: true}, nil
	case <-ctx.Done():
		k.ended <- ctx.Err()
		return nil, ctx.Err()
	}
}

func (k *roomKV) Decode(ctx context.Context, r KVRequest) (*KVResult, error) {
	k.mu.Lock()
	k.decodes = append(k.decodes, r)
	k.mu.Unlock()
	room := k.room(r.Room)
	select {
	case got := <-room.prompt:
		close(room.taken)
		return &KVResult{Bytes: int64(len(got)), Transport: "test", ChecksumOK: bytes.Equal(got, r.Prompt)}, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// With a KV engine, the prefill sends the KV into a room named after
// remote_request_id and names its kvproxy's bootstrap port; the decode
// receives the room from that address and reports the transfer; a room
// nobody takes ends at the KV timeout.
func TestVLLMKVThroughTheKVEngine(t *testing.T) {
	kv := newRoomKV()
	p := start(t, Config{Role: RoleVLLMPrefill, KV: kv, BootstrapPort: 9123, VLLMKVTimeout: 300 * time.Millisecond})
	d := start(t, Config{Role: RoleVLLMDecode, KV: kv, Tokens: 2})
	prompt := strings.Repeat("w ", 20)
	params := vllmPrefill(t, p, prompt, "rid-1")
	var got struct {
		Port      int    `json:"remote_port"`
		Host      string `json:"remote_host"`
		RequestID string `json:"remote_request_id"`
	}
	if err := json.Unmarshal(params, &got); err != nil || got.Port != 9123 {
		t.Fatalf("params %s: remote_port should be the kvproxy's bootstrap port 9123", params)
	}
	req := `{"model":"mock","prompt":"` + prompt + `","kv_transfer_params":` + string(params) + `}`
	if status, _, body := d.post("/v1/completions", req, "X-Request-Id", "other"); status != 500 || !strings.Contains(string(body), `was not made for X-Request-Id \"other\"`) {
		t.Errorf("decode under another X-Request-Id: %d %s", status, body)
	}
	status, _, body := d.post("/v1/completions", req, "X-Request-Id", "rid-1")
	var reply struct {
		KV *KVResult `json:"kv_transfer"`
	}
	if err := json.Unmarshal(body, &reply); status != 200 || err != nil || reply.KV == nil || !reply.KV.ChecksumOK {
		t.Fatalf("decode: %d %s, want kv_transfer with checksum_ok", status, body)
	}
	kv.mu.Lock()
	dr := kv.decodes[len(kv.decodes)-1]
	kv.mu.Unlock()
	if dr.BootstrapHost != got.Host || dr.BootstrapPort != 9123 || dr.Room != vllmRoom(got.RequestID) {
		t.Errorf("decode received %+v, want room %d from %s:9123", dr, vllmRoom(got.RequestID), got.Host)
	}
	if pulls := d.s.VLLMPulls(); len(pulls) != 2 || pulls[1].KV == nil || !pulls[1].KV.ChecksumOK || pulls[0].Error == "" {
		t.Errorf("pulls %+v", pulls)
	}

	for deadline := time.Now().Add(2 * time.Second); len(p.s.VLLMHeldKV()) != 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("held %+v after the decode took the KV", p.s.VLLMHeldKV())
		}
	}

	t0 := time.Now()
	vllmPrefill(t, p, prompt, "rid-2") // no decode comes
	select {
	case <-kv.ended:
		if took := time.Since(t0); took < 300*time.Millisecond {
			t.Errorf("an untaken room ended after %v, before the 300 ms KV timeout", took)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("an untaken room outlived the KV timeout")
	}
	for deadline := time.Now().Add(2 * time.Second); len(p.s.VLLMHeldKV()) != 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("held %+v after the timeout", p.s.VLLMHeldKV())
		}
	}
}

// A room whose decode has not come yet ends when the prefill mock closes.
func TestVLLMKVSendEndsAtClose(t *testing.T) {
	kv := newRoomKV()
	p := start(t, Config{Role: RoleVLLMPrefill, KV: kv})
	vllmPrefill(t, p, "a b", "rid-1")
	if err := p.s.Close(); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-kv.ended:
		if err != context.Canceled {
			t.Errorf("transfer ended with %v at Close", err)
		}
	default:
		t.Fatal("Close returned with the transfer still under way")
	}
}

// A decode's pulls share one kept-alive connection to the prefill's side
// channel: a connection per pull made the mock, not the router, the bench's
// biggest cost (make bench-vllm).
func TestVLLMDecodePullsReuseOneConnection(t *testing.T) {
	p := start(t, Config{Role: RoleVLLMPrefill})
	d := start(t, Config{Role: RoleVLLMDecode, Tokens: 2})
	var conns atomic.Int32
	side := httptest.NewUnstartedServer(p.s.srv.Handler)
	side.Config.ConnState = func(_ net.Conn, st http.ConnState) {
		if st == http.StateNew {
			conns.Add(1)
		}
	}
	side.Start()
	t.Cleanup(side.Close)
	_, sidePort, _ := net.SplitHostPort(side.Listener.Addr().String())
	const pulls = 5
	for i := range pulls {
		xid := "rid-" + strconv.Itoa(i)
		params := vllmPrefill(t, p, "one two three", xid)
		var m map[string]any
		if err := json.Unmarshal(params, &m); err != nil {
			t.Fatal(err)
		}
		m["remote_port"], _ = strconv.Atoi(sidePort) // pull through the counting listener
		params, _ = json.Marshal(m)
		req := `{"model":"mock","prompt":"one two three","kv_transfer_params":` + string(params) + `}`
		if status, _, body := d.post("/v1/completions", req, "X-Request-Id", xid); status != 200 {
			t.Fatalf("decode %d: %d %s", i, status, body)
		}
	}
	if n := conns.Load(); n != 1 {
		t.Errorf("%d pulls opened %d connections to the prefill, want 1", pulls, n)
	}
	if pulls := d.s.VLLMPulls(); len(pulls) != 5 {
		t.Errorf("decode recorded %d pulls, want 5", len(pulls))
	}
}

// A pull runs on the decode handler's goroutine: a kept side-channel
// connection costs the decode no goroutine, where net/http's client held
// two per connection and handed each pull between them.
func TestVLLMDecodePullsKeepNoClientGoroutines(t *testing.T) {
	p := start(t, Config{Role: RoleVLLMPrefill})
	d := start(t, Config{Role: RoleVLLMDecode, Tokens: 2})
	p.get("/health") // the harness's own connections, and their goroutines, first
	d.get("/health")
	time.Sleep(50 * time.Millisecond)
	before := runtime.NumGoroutine()
	for i := range 3 {
		xid := "rid-g" + strconv.Itoa(i)
		params := vllmPrefill(t, p, "one two", xid)
		if status, _, body := d.post("/v1/completions", `{"prompt":"one two","kv_transfer_params":`+string(params)+`}`, "X-Request-Id", xid); status != 200 {
			t.Fatalf("decode: %d %s", status, body)
		}
	}
	// One kept side-channel connection: the prefill's server goroutine for it, nothing on the decode's side.
	var now int
	for range 100 {
		if now = runtime.NumGoroutine(); now <= before+1 {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Errorf("%d goroutines after 3 pulls over one kept connection, %d before: want at most 1 more", now, before)
}

// A kept side-channel connection the prefill has closed costs the next pull
// nothing: it goes out on a fresh one.
func TestVLLMDecodePullSurvivesAClosedKeptConnection(t *testing.T) {
	p := start(t, Config{Role: RoleVLLMPrefill})
	d := start(t, Config{Role: RoleVLLMDecode, Tokens: 2})
	for i := range 2 {
		xid := "rid-c" + strconv.Itoa(i)
		params := vllmPrefill(t, p, "one two", xid)
		if status, _, body := d.post("/v1/completions", `{"prompt":"one two","kv_transfer_params":`+string(params)+`}`, "X-Request-Id", xid); status != 200 {
			t.Fatalf("decode %d: %d %s", i, status, body)
		}
		p.s.srv.SetKeepAlivesEnabled(false) // closes the idle side-channel connection (and the harness's)
		p.s.srv.SetKeepAlivesEnabled(true)
		p.client.CloseIdleConnections()
	}
	if pulls := d.s.VLLMPulls(); len(pulls) != 2 || pulls[1].Error != "" {
		t.Errorf("pulls %+v", pulls)
	}
}
