// Package bootstrap is SGLang's prefill-side bootstrap HTTP API
// (CommonKVBootstrapServer, as of SGLang 0.5.23): prefill ranks register
// with PUT /route, decode reads the topology and a rank's address with GET
// /route, DP ranks of rooms go through /register_dp_rank and
// /query_dp_ranks, /health answers "OK". It answers SGLang's own clients
// exactly as SGLang's server does (status codes, texts, reply fields, the
// first registration fixing the topology), so either server can stand in
// for the other. The prefill kvproxy serves it on the bootstrap port and
// registers itself as the only rank once its engine described its layout,
// so the router's bootstrap_host/port/room need no change.
package bootstrap

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
)

// RankInfo is what the kvproxy registers for itself (PUT /route's fields).
type RankInfo struct {
	AttnTPSize               int    `json:"attn_tp_size"`
	AttnTPRank               int    `json:"attn_tp_rank"`
	AttnCPSize               int    `json:"attn_cp_size"`
	AttnCPRank               int    `json:"attn_cp_rank"`
	AttnDPSize               int    `json:"attn_dp_size"`
	AttnDPRank               int    `json:"attn_dp_rank"`
	PPSize                   int    `json:"pp_size"`
	PPRank                   int    `json:"pp_rank"`
	SystemDPSize             int    `json:"system_dp_size"`
	SystemDPRank             int    `json:"system_dp_rank"`
	RankIP                   string `json:"rank_ip"`
	RankPort                 int    `json:"rank_port"`
	PageSize                 int    `json:"page_size"`
	KVCacheDtype             string `json:"kv_cache_dtype"`
	LoadBalanceMethod        string `json:"load_balance_method,omitempty"`
	EnableDSACacheLayerSplit bool   `json:"enable_dsa_cache_layer_split"`
	EnableKVCacheSharding    bool   `json:"enable_kv_cache_sharding"`
	PrefillHTTPPort          int    `json:"prefill_http_port,omitempty"` // 0: none
}

// Topology is what the kvproxy's resolver reads of GET /route with every
// rank -1.
type Topology struct {
	PageSize     int    `json:"page_size"`
	KVCacheDtype string `json:"kv_cache_dtype"`
}

// RankAddr is GET /route for one rank: where its transfer engine listens.
type RankAddr struct {
	RankIP   string `json:"rank_ip"`
	RankPort int64  `json:"rank_port"`
}

type rankKey struct{ dp, cp, tp, pp int64 }

type dpEntry struct {
	rank int64
	at   time.Time
}

// Server holds the tables. The zero value is not usable; use NewServer.
type Server struct {
	// EntryTTL is how long a room's DP rank is kept (SGLang: 120 s).
	EntryTTL time.Duration

	mu sync.Mutex
	// The topology, fixed field by field by the first registration that
	// sets it (nil: not yet, Python's None).
	attnTPSize, attnCPSize, dpSize, ppSize, pageSize, prefillHTTPPort *int64
	kvCacheDtype, kvLayout                                            any
	dsv41SpecLayout                                                   any
	followBootstrapRoom, enableDSA, enableSharding                    *bool
	decodeAllocationPolicy                                            any
	registered                                                        int
	ranks                                                             map[rankKey]RankAddr
	dp                                                                map[int64]dpEntry
}

// NewServer returns an empty server.
func NewServer() *Server {
	return &Server{EntryTTL: 120 * time.Second, decodeAllocationPolicy: "early",
		ranks: map[rankKey]RankAddr{}, dp: map[int64]dpEntry{}}
}

// Register records a prefill rank, as PUT /route does.
func (s *Server) Register(r RankInfo) error {
	b, err := json.Marshal(r)
	if err != nil {
		return err
	}
	body, err := decodeObject(b)
	if err != nil {
		return err
	}
	if herr := s.register(body); herr != nil {
		return fmt.Errorf("bootstrap register: %d %s", herr.code, herr.text)
	}
	return nil
}

// httpError is an answer other than 200; internal ones stand for the
// exceptions (missing keys, bad numbers) that make aiohttp answer 500.
type httpError struct {
	code int
	text string
}

func internal(format string, a ...any) *httpError {
	return &httpError{http.StatusInternalServerError, "500 Internal Server Error\n\nServer got itself in trouble: " + fmt.Sprintf(format, a...)}
}

// body is a decoded JSON object; numbers stay json.Number.
type body map[string]any

func decodeObject(b []byte) (body, error) {
	d := json.NewDecoder(bytes.NewReader(b))
	d.UseNumber()
	var v body
	if err := d.Decode(&v); err != nil {
		return nil, err
	}
	if _, err := d.Token(); err != io.EOF { // json.loads takes one value and whitespace
		return nil, fmt.Errorf("extra data after the JSON object")
	}
	if v == nil {
		return nil, fmt.Errorf("JSON body is not an object")
	}
	return v, nil
}

// need returns data[key] or the KeyError SGLang would raise.
func (b body) need(key string) (any, *httpError) {
	v, ok := b[key]
	if !ok {
		return nil, internal("KeyError: '%s'", key)
	}
	return v, nil
}

// pyInt converts v as Python's int() does for what JSON can carry.
func pyInt(v any) (int64, bool) {
	switch x := v.(type) {
	case json.Number:
		if n, err := x.Int64(); err == nil {
			return n, true
		}
		if f, err := x.Float64(); err == nil && !math.IsInf(f, 0) && math.Abs(f) < 1<<63 {
			return int64(f), true // int() truncates
		}
	case string:
		v := parseRank(x)
		return v.n, v.valid && !v.big
	case bool:
		if x {
			return 1, true
		}
		return 0, true
	}
	return 0, false
}

func (b body) needInt(key string) (int64, *httpError) {
	v, herr := b.need(key)
	if herr != nil {
		return 0, herr
	}
	n, ok := pyInt(v)
	if !ok {
		return 0, internal("int() of %s=%v", key, v)
	}
	return n, nil
}

// truthy is Python's bool() of a JSON value.
func truthy(v any) bool {
	switch x := v.(type) {
	case nil:
		return false
	case bool:
		return x
	case json.Number:
		f, err := x.Float64()
		return err != nil || f != 0
	case string:
		return x != ""
	case []any:
		return len(x) > 0
	case map[string]any:
		return len(x) > 0
	}
	return true
}

func setOnce[T any](p **T, v T) {
	if *p == nil {
		*p = &v
	}
}

// register is _handle_route_put on a decoded body.
func (s *Server) register(data body) *httpError {
	s.mu.Lock()
	defer s.mu.Unlock()
	// Read in SGLang's order: the first key missing or not a number is
	// the one its 500 names.
	n := map[string]int64{}
	var ip, dtype any
	for _, key := range []string{"attn_tp_size", "attn_tp_rank", "attn_cp_size", "attn_cp_rank", "attn_dp_size", "attn_dp_rank",
		"pp_size", "pp_rank", "system_dp_size", "system_dp_rank", "rank_ip", "rank_port", "page_size", "kv_cache_dtype"} {
		var herr *httpError
		switch key {
		case "rank_ip":
			ip, herr = data.need(key)
		case "kv_cache_dtype":
			dtype, herr = data.need(key)
		default:
			n[key], herr = data.needInt(key)
		}
		if herr != nil {
			return herr
		}
	}
	var httpPort *int64
	if v := data["prefill_http_port"]; v != nil {
		p, ok := pyInt(v)
		if !ok {
			return internal("int() of prefill_http_port=%v", v)
		}
		httpPort = &p
	}
	spec := data["dsv41_spec_layout"]
	if s.registered > 0 && !reflect.DeepEqual(s.dsv41SpecLayout, spec) {
		return &httpError{http.StatusBadRequest, "DeepSeek-V4.1 DSpark PD layout differs across prefill ranks"}
	}
	policy, ok := data["decode_allocation_policy"]
	if !ok {
		policy = "early"
	}
	if s.registered > 0 && !reflect.DeepEqual(s.decodeAllocationPolicy, policy) {
		return &httpError{http.StatusBadRequest, "Inconsistent prefill allocation policies"}
	}
	s.dsv41SpecLayout, s.decodeAllocationPolicy = spec, policy
	setOnce(&s.attnTPSize, n["attn_tp_size"])
	setOnce(&s.attnCPSize, n["attn_cp_size"])
	group := n["attn_dp_rank"]
	if n["system_dp_size"] == 1 {
		setOnce(&s.dpSize, n["attn_dp_size"])
	} else {
		setOnce(&s.dpSize, n["system_dp_size"])
		group = n["system_dp_rank"]
	}
	setOnce(&s.ppSize, n["pp_size"])
	setOnce(&s.pageSize, n["page_size"])
	if s.kvCacheDtype == nil {
		s.kvCacheDtype = dtype
	}
	if s.kvLayout == nil {
		s.kvLayout = data["kv_layout"]
	}
	if s.prefillHTTPPort == nil && httpPort != nil {
		s.prefillHTTPPort = httpPort
	}
	if s.followBootstrapRoom == nil {
		lb, ok := data["load_balance_method"]
		if !ok {
			lb = "follow_bootstrap_room"
		}
		setOnce(&s.followBootstrapRoom, lb == "follow_bootstrap_room")
	}
	setOnce(&s.enableDSA, truthy(data["enable_dsa_cache_layer_split"]))
	setOnce(&s.enableSharding, truthy(data["enable_kv_cache_sharding"]))
	s.ranks[rankKey{group, n["attn_cp_rank"], n["attn_tp_rank"], n["pp_rank"]}] = RankAddr{RankIP: pyStr(ip), RankPort: n["rank_port"]}
	s.registered++
	return nil
}

// pyStr is Python's str() of a JSON scalar.
func pyStr(v any) string {
	switch x := v.(type) {
	case string:
		return x
	case nil:
		return "None"
	case bool:
		if x {
			return "True"
		}
		return "False"
	}
	return fmt.Sprint(v)
}

func (s *Server) readyLocked() bool {
	if s.attnTPSize == nil || s.attnCPSize == nil || s.ppSize == nil || s.dpSize == nil {
		return false
	}
	want := *s.dpSize
	for _, n := range []*int64{s.attnCPSize, s.attnTPSize, s.ppSize} {
		want *= *n
	}
	return int64(s.registered) >= want
}

func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	switch r.URL.Path {
	case "/route":
		switch r.Method {
		case http.MethodPut:
			data, herr := readObject(w, r)
			if herr == nil {
				herr = s.register(data)
			}
			if herr == nil {
				herr = &httpError{http.StatusOK, "OK"}
			}
			writeText(w, herr.code, herr.text)
		case http.MethodGet:
			s.getRoute(w, r)
		default:
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusMethodNotAllowed)
			_, _ = w.Write([]byte("Method not allowed"))
		}
	case "/register_dp_rank":
		if !allow(w, r, http.MethodPost) {
			return
		}
		data, herr := readObject(w, r)
		var room, rank int64
		if herr == nil {
			room, herr = data.needInt("bootstrap_room")
		}
		if herr == nil {
			rank, herr = data.needInt("dp_rank")
		}
		if herr != nil {
			writeText(w, herr.code, herr.text)
			return
		}
		s.mu.Lock()
		s.expireLocked()
		s.dp[room] = dpEntry{rank: rank, at: time.Now()}
		s.mu.Unlock()
		writeText(w, http.StatusOK, "OK")
	case "/query_dp_ranks":
		if !allow(w, r, http.MethodPost) {
			return
		}
		s.queryDPRanks(w, r)
	case "/health":
		if !allow(w, r, http.MethodGet, http.MethodHead) {
			return
		}
		writeText(w, http.StatusOK, "OK")
	default:
		writeText(w, http.StatusNotFound, "404: Not Found")
	}
}

// allow answers 405 (as aiohttp does for a route of other methods) unless
// r's method is one of methods.
func allow(w http.ResponseWriter, r *http.Request, methods ...string) bool {
	if slices.Contains(methods, r.Method) {
		return true
	}
	w.Header().Set("Allow", strings.Join(methods, ","))
	writeText(w, http.StatusMethodNotAllowed, "405: Method Not Allowed")
	return false
}

func readObject(w http.ResponseWriter, r *http.Request) (body, *httpError) {
	b, err := io.ReadAll(http.MaxBytesReader(w, r.Body, 1<<20))
	if err != nil {
		return nil, internal("reading the body: %v", err)
	}
	data, err := decodeObject(b)
	if err != nil {
		return nil, internal("JSONDecodeError: %v", err)
	}
	return data, nil
}

func (s *Server) queryDPRanks(w http.ResponseWriter, r *http.Request) {
	data, herr := readObject(w, r)
	var rooms any
	if herr == nil {
		rooms, herr = data.need("bootstrap_rooms")
	}
	list, ok := rooms.([]any)
	if herr == nil && !ok {
		herr = internal("bootstrap_rooms is not a list")
	}
	if herr != nil {
		writeText(w, herr.code, herr.text)
		return
	}
	var out pyObject
	seen := map[int64]bool{} // a dict: a room asked for twice is one key
	s.mu.Lock()
	defer s.mu.Unlock()
	s.expireLocked()
	for _, v := range list {
		room, ok := pyInt(v)
		if !ok {
			writeText(w, http.StatusInternalServerError, internal("int() of room %v", v).text)
			return
		}
		if e, ok := s.dp[room]; ok && !seen[room] {
			seen[room] = true
			out.set(strconv.FormatInt(room, 10), e.rank)
		}
	}
	writeJSON(w, out)
}

func (s *Server) expireLocked() {
	now := time.Now()
	for room, e := range s.dp {
		if now.Sub(e.at) > s.EntryTTL {
			delete(s.dp, room)
		}
	}
}

// getRoute is _handle_route_get, down to the order in which it parses the
// ranks: int() raises (500) only on a rank it reaches, and the all -1
// test, the readiness check (503) and the table lookup (404 at the first
// rank the table lacks) each stop it early.
func (s *Server) getRoute(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	names := [4]string{"prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank"}
	var raw [4]string
	for i, name := range names {
		if raw[i] = q.Get(name); raw[i] == "" {
			writeText(w, http.StatusBadRequest, "Missing inputs for bootstrap server.")
			return
		}
	}
	var k [4]rankValue
	parse := func(i int) bool {
		if k[i] = parseRank(raw[i]); !k[i].valid {
			writeText(w, http.StatusInternalServerError, internal("ValueError: invalid literal for int() with base 10: '%s'", raw[i]).text)
		}
		return k[i].valid
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	topology := true
	for i := range k {
		if !parse(i) {
			return
		}
		if !k[i].is(-1) {
			topology = false
			break
		}
	}
	if !s.readyLocked() {
		writeText(w, http.StatusServiceUnavailable, fmt.Sprintf("Prefill server not fully registered yet (%d workers registered).", s.registered))
		return
	}
	if topology {
		writeJSON(w, s.topologyLocked())
		return
	}
	// The table is nested dp → cp → tp → pp: a rank is looked up once the
	// ones before it were found.
	for i := range k {
		if i > 0 && !parse(i) { // k[0] is parsed already
			return
		}
		if !s.hasPrefixLocked(k[:i+1]) {
			writeText(w, http.StatusNotFound, fmt.Sprintf("Bootstrap info not found for dp_rank=%s cp_rank=%s tp_rank=%s pp_rank=%s", raw[0], raw[1], raw[2], raw[3]))
			return
		}
	}
	a := s.ranks[rankKey{k[0].n, k[1].n, k[2].n, k[3].n}]
	var out pyObject
	out.set("rank_ip", a.RankIP)
	out.set("rank_port", a.RankPort)
	writeJSON(w, out)
}

// rankValue is Python's int() of a string: valid or not, and a valid one
// too big for int64 (big) matches no rank.
type rankValue struct {
	n          int64
	valid, big bool
}

func (v rankValue) is(n int64) bool { return v.valid && !v.big && v.n == n }

func parseRank(s string) rankValue {
	t := strings.ReplaceAll(strings.TrimSpace(s), "_", "")
	n, err := strconv.ParseInt(t, 10, 64)
	if errors.Is(err, strconv.ErrRange) {
		return rankValue{valid: true, big: true}
	}
	return rankValue{n: n, valid: err == nil}
}

// hasPrefixLocked reports whether a registered rank starts with the ranks
// in p (dp, then cp, tp, pp).
func (s *Server) hasPrefixLocked(p []rankValue) bool {
	for key := range s.ranks {
		ks := [4]int64{key.dp, key.cp, key.tp, key.pp}
		match := true
		for i, v := range p {
			match = match && v.is(ks[i])
		}
		if match {
			return true
		}
	}
	return false
}

// topologyLocked is dataclasses.asdict(PrefillServerInfo(...)) in field
// order, without kv_layout and dsv41_spec_layout when they are None.
func (s *Server) topologyLocked() pyObject {
	var o pyObject
	o.set("attn_tp_size", *s.attnTPSize)
	o.set("attn_cp_size", *s.attnCPSize)
	o.set("dp_size", *s.dpSize)
	o.set("pp_size", *s.ppSize)
	o.set("page_size", *s.pageSize)
	if s.kvCacheDtype == nil {
		o.set("kv_cache_dtype", nil)
	} else {
		o.set("kv_cache_dtype", pyStr(s.kvCacheDtype))
	}
	o.set("follow_bootstrap_room", s.followBootstrapRoom == nil || *s.followBootstrapRoom)
	o.set("enable_dsa_cache_layer_split", s.enableDSA != nil && *s.enableDSA)
	if s.dsv41SpecLayout != nil {
		o.set("dsv41_spec_layout", s.dsv41SpecLayout)
	}
	if s.kvLayout != nil {
		o.set("kv_layout", s.kvLayout)
	}
	o.set("decode_allocation_policy", s.decodeAllocationPolicy)
	o.set("enable_kv_cache_sharding", s.enableSharding != nil && *s.enableSharding)
	o.set("prefill_http_port", s.prefillHTTPPort) // nil: null
	for _, k := range []string{"target_tp_rank", "target_tp_ranks", "target_cp_ranks", "target_pp_ranks", "required_dst_info_num", "required_prefill_response_num"} {
		o.set(k, nil)
	}
	return o
}

// pyObject is a JSON object that keeps its key order and is written the
// way Python's json.dumps writes (", " and ": " separators).
type pyObject struct {
	keys []string
	vals []any
}

func (o *pyObject) set(k string, v any) {
	o.keys = append(o.keys, k)
	o.vals = append(o.vals, v)
}

func (o pyObject) MarshalJSON() ([]byte, error) {
	var b bytes.Buffer
	b.WriteByte('{')
	for i, k := range o.keys {
		if i > 0 {
			b.WriteString(", ")
		}
		kb, _ := json.Marshal(k)
		b.Write(kb)
		b.WriteString(": ")
		var vb bytes.Buffer
		enc := json.NewEncoder(&vb)
		enc.SetEscapeHTML(false)
		if err := enc.Encode(o.vals[i]); err != nil {
			return nil, err
		}
		b.Write(bytes.TrimSuffix(vb.Bytes(), []byte("\n")))
	}
	b.WriteByte('}')
	return b.Bytes(), nil
}

func writeText(w http.ResponseWriter, code int, text string) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.WriteHeader(code)
	_, _ = w.Write([]byte(text))
}

func writeJSON(w http.ResponseWriter, o pyObject) {
	b, err := o.MarshalJSON()
	if err != nil {
		writeText(w, http.StatusInternalServerError, internal("%v", err).text)
		return
	}
	w.Header().Set("Content-Type", "application/json; charset=utf-8")
	_, _ = w.Write(b)
}
