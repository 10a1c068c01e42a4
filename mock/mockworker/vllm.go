package mockworker

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
)

// The vLLM roles play a vLLM OpenAI server run with a KV connector for
// prefill/decode disaggregation (NixlConnector's fields):
//
//   - vllm-prefill: a chat or completions request whose kv_transfer_params
//     has do_remote_decode true keeps its KV blocks for a remote decode and
//     answers, in its JSON reply, kv_transfer_params naming them:
//     {"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids",
//     "remote_engine_id","remote_request_id","remote_host","remote_port",
//     "tp_size"}. The blocks stay held until a decode pulls them or
//     Config.VLLMKVTimeout passes (vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT);
//     a client that leaves before the reply frees them at once.
//   - vllm-decode: a chat or completions request must carry such
//     kv_transfer_params (400 naming the field otherwise), and the decode
//     pulls the blocks from remote_host:remote_port (POST /_mock/vllm/pull)
//     before it answers: a prefill it cannot reach, that does not hold the
//     request (wrong engine, request or blocks, or another X-Request-Id),
//     or KV of another prompt is a 500.
//
// With a KV engine (Config.KV: cmd/mockworker --kvproxy) the KV itself
// moves through kvproxy, as the SGLang roles' does, in a room both sides
// name after remote_request_id (vllmRoom): the prefill fills and sends its
// pages when it answers and names its kvproxy's bootstrap address
// (remote_host, remote_port = Config.BootstrapPort) in place of its own;
// the decode expects the room from that address and checks every page
// before its first token, and its reply carries kv_transfer (checksum_ok)
// as the SGLang roles' OpenAI replies do. The prefill's room ends when the
// decode has its pages, at Config.VLLMKVTimeout, or at once when the
// prefill's client leaves before the reply.
//
// Both honour max_tokens, as vLLM does, and record what they got
// (/_mock/requests; /_mock/vllm/held and /_mock/vllm/pulls for the KV).
// SGLang's own endpoints (/generate, /get_server_info, /server_info,
// /get_load, /v1/loads, /get_model_info, /model_info, /flush_cache,
// /health_generate) answer 404, as vLLM's server has none of them.

const (
	RoleVLLMPrefill Role = "vllm-prefill"
	RoleVLLMDecode  Role = "vllm-decode"
)

// DefaultVLLMKVTimeout is vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT default.
const DefaultVLLMKVTimeout = 480 * time.Second

// vllmBlockSize is the tokens per KV block the mock counts in (vLLM's default).
const vllmBlockSize = 16

func (r Role) vllm() bool { return r == RoleVLLMPrefill || r == RoleVLLMDecode }

// sglangOnly are the routes a vLLM server does not have.
var sglangOnly = map[string]bool{"/generate": true, "/get_server_info": true, "/server_info": true,
	"/get_load": true, "/v1/loads": true, "/get_model_info": true, "/model_info": true,
	"/flush_cache": true, "/health_generate": true}

// VLLMHeld is a request whose KV a vllm-prefill keeps for a decode.
type VLLMHeld struct {
	RequestID  string `json:"request_id"`   // remote_request_id
	XRequestID string `json:"x_request_id"` // the prefill request's X-Request-Id
	Blocks     []int  `json:"blocks"`
}

// VLLMPull is one KV pull a vllm-decode made.
type VLLMPull struct {
	XRequestID string          `json:"x_request_id"`
	Params     json.RawMessage `json:"kv_transfer_params"`
	Error      string          `json:"error,omitempty"`       // "" when the KV arrived
	KV         *KVResult       `json:"kv_transfer,omitempty"` // through kvproxy: what moved
}

// vllmKV is the roles' KV state: held blocks (prefill), pulls (decode).
type vllmKV struct {
	mu     sync.Mutex
	engine string
	held   map[string]*heldKV
	next   int
	pulls  []VLLMPull
	// idle are the decode's side-channel connections not in use, by
	// prefill address (vllmpull.go).
	idle map[string][]*pullConn
	// sends are the prefill's transfers through kvproxy, which outlive
	// their requests; stop ends them at Close.
	sends sync.WaitGroup
	ctx   context.Context
	stop  context.CancelFunc
}

type heldKV struct {
	VLLMHeld
	digest string
	expiry *time.Timer
	cancel context.CancelFunc // ends the kvproxy transfer, if any
}

// vllmParams is the kv_transfer_params a vllm role reads.
type vllmParams struct {
	DoRemoteDecode  bool            `json:"do_remote_decode"`
	DoRemotePrefill bool            `json:"do_remote_prefill"`
	RemoteEngineID  *string         `json:"remote_engine_id"`
	RemoteRequestID *string         `json:"remote_request_id"`
	RemoteBlockIDs  []int           `json:"remote_block_ids"`
	RemoteHost      *string         `json:"remote_host"`
	RemotePort      json.RawMessage `json:"remote_port"`
	TPSize          *int            `json:"tp_size"`
}

// prefillParams is the kv_transfer_params of a vllm-prefill's reply, keys
// sorted as the map it replaces wrote them (a map cost every reply's
// encoding a sort and a reflection per key).
type prefillParams struct {
	DoRemoteDecode  bool   `json:"do_remote_decode"`
	DoRemotePrefill bool   `json:"do_remote_prefill"`
	RemoteBlockIDs  []int  `json:"remote_block_ids"`
	RemoteEngineID  string `json:"remote_engine_id"`
	RemoteHost      string `json:"remote_host"`
	RemotePort      int    `json:"remote_port"`
	RemoteRequestID string `json:"remote_request_id"`
	TPSize          int    `json:"tp_size"`
}

// VLLMHeldKV returns the requests whose KV the prefill keeps.
func (s *Server) VLLMHeldKV() []VLLMHeld {
	s.vkv.mu.Lock()
	defer s.vkv.mu.Unlock()
	out := make([]VLLMHeld, 0, len(s.vkv.held))
	for _, h := range s.vkv.held {
		out = append(out, h.VLLMHeld)
	}
	return out
}

// VLLMPulls returns the KV pulls the decode made, oldest first: the last
// Config.RecordLimit, cleared by Reset.
func (s *Server) VLLMPulls() []VLLMPull {
	s.vkv.mu.Lock()
	defer s.vkv.mu.Unlock()
	return append([]VLLMPull(nil), s.vkv.pulls...)
}

// vllmRoutes adds the vLLM roles' endpoints to mux and hides SGLang's.
func (s *Server) vllmRoutes(mux *http.ServeMux) http.Handler {
	if !s.cfg.Role.vllm() {
		return mux
	}
	s.vkv.engine = "mock-engine-" + s.idPrefix
	s.vkv.held = map[string]*heldKV{}
	s.vkv.ctx, s.vkv.stop = context.WithCancel(context.Background())
	s.vkv.idle = map[string][]*pullConn{}
	mux.HandleFunc("POST /_mock/vllm/pull", s.vllmPull)
	mux.HandleFunc("GET /_mock/vllm/held", func(w http.ResponseWriter, _ *http.Request) { s.writeAny(w, s.VLLMHeldKV()) })
	mux.HandleFunc("GET /_mock/vllm/pulls", func(w http.ResponseWriter, _ *http.Request) { s.writeAny(w, s.VLLMPulls()) })
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if sglangOnly[r.URL.Path] {
			http.NotFound(w, r)
			return
		}
		mux.ServeHTTP(w, r)
	})
}

// vllmAnswer answers a chat or completions request in a vLLM role.
func (s *Server) vllmAnswer(a *answer, r *http.Request) error {
	params := a.req.kvParams // parseRequest read it
	fail := func(e *apiError) error {
		if a.ev != nil { // the stream's head is out
			return a.ev.write(errorBody(e.status, e.message))
		}
		return writeError(a.w, e)
	}
	if s.cfg.Role == RoleVLLMDecode {
		kv, e := s.vllmFetch(a.ctx, r, params, a.seqs)
		if e != nil {
			if a.ctx.Err() != nil {
				return errClientGone
			}
			return fail(e)
		}
		if kv != nil {
			a.kv = []*KVResult{kv}
		}
		return a.vllmReply()
	}
	var p vllmParams
	if !isNull(params) {
		if err := json.Unmarshal(params, &p); err != nil {
			return fail(badRequest("kv_transfer_params: %v", err))
		}
	}
	if !p.DoRemoteDecode {
		return a.vllmReply()
	}
	held := s.vkv.hold(r, a.seqs, s.cfg.VLLMKVTimeout)
	host, port, _ := net.SplitHostPort(s.Addr())
	portN, _ := strconv.Atoi(port)
	if s.cfg.KV != nil {
		portN = s.cfg.BootstrapPort
		s.vllmSend(held, a.seqs)
	}
	a.vllmParams = &prefillParams{DoRemotePrefill: true, RemoteBlockIDs: held.Blocks, RemoteEngineID: s.vkv.engine,
		RemoteRequestID: held.RequestID, RemoteHost: host, RemotePort: portN, TPSize: s.cfg.Engine.TPSize}
	err := a.vllmReply()
	if err != nil || a.ctx.Err() != nil { // vLLM aborts a request whose client left: its blocks are freed
		s.vkv.drop(held.RequestID)
	}
	return err
}

func (a *answer) vllmReply() error {
	if a.req.ep == epChat {
		return a.chat()
	}
	return a.completions()
}

// vllmDigest stands for the KV of the request's prompts.
func vllmDigest(seqs []sequence) string {
	h := fnv.New64a()
	for _, sq := range seqs {
		if sq.firstChoice {
			h.Write(sq.prompt.text)
			h.Write([]byte{0})
		}
	}
	return strconv.FormatUint(h.Sum64(), 16)
}

// hold keeps the request's blocks for a decode, as vLLM's request id
// ("cmpl-" and the X-Request-Id it was sent) names them.
func (k *vllmKV) hold(r *http.Request, seqs []sequence, timeout time.Duration) *heldKV {
	xid := r.Header.Get("X-Request-Id")
	n := max((promptTokens(seqs)+vllmBlockSize-1)/vllmBlockSize, 1)
	k.mu.Lock()
	defer k.mu.Unlock()
	h := &heldKV{VLLMHeld: VLLMHeld{XRequestID: xid}, digest: vllmDigest(seqs)}
	h.RequestID = fmt.Sprintf("cmpl-%s-%d", xid, k.next)
	for range n {
		h.Blocks = append(h.Blocks, k.next)
		k.next++
	}
	k.held[h.RequestID] = h
	id := h.RequestID
	h.expiry = time.AfterFunc(timeout, func() { k.drop(id) })
	return h
}

func (k *vllmKV) drop(id string) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if h := k.held[id]; h != nil {
		h.expiry.Stop()
		if h.cancel != nil {
			h.cancel()
		}
		delete(k.held, id)
	}
}

// close ends the prefill's transfers under way and waits for them.
func (k *vllmKV) close() {
	if k.stop != nil {
		k.stop()
	}
	k.sends.Wait()
	k.closeIdle()
}

// vllmRoom is the kvproxy room of a held request: both sides derive it from
// remote_request_id, which vLLM's connectors already carry.
func vllmRoom(requestID string) uint64 {
	h := fnv.New64a()
	h.Write([]byte(requestID))
	return h.Sum64() & (1<<63 - 1)
}

// vllmKVRequest is the kvproxy transfer of a request's prompts (the first
// choice of each, as vLLM keeps one KV per prompt).
func vllmKVRequest(requestID string, seqs []sequence) KVRequest {
	var prompt []byte
	for _, sq := range seqs {
		if sq.firstChoice {
			prompt = append(append(prompt, sq.prompt.text...), 0)
		}
	}
	return KVRequest{Room: vllmRoom(requestID), Prompt: prompt, PromptTokens: max(promptTokens(seqs), 1)}
}

// vllmSend starts sending h's KV through kvproxy: the room waits there for
// the decode that names it until h is dropped (its timer: vLLM's abort
// timeout), and h is let go when it ends.
func (s *Server) vllmSend(h *heldKV, seqs []sequence) {
	k := &s.vkv
	ctx, cancel := context.WithCancel(k.ctx)
	k.mu.Lock()
	h.cancel = cancel
	dropped := k.held[h.RequestID] != h // its timer already fired
	k.mu.Unlock()
	if dropped {
		cancel()
		return
	}
	req := vllmKVRequest(h.RequestID, seqs)
	k.sends.Add(1)
	go func() {
		defer k.sends.Done()
		defer k.drop(h.RequestID)
		_, _ = s.cfg.KV.Prefill(ctx, req) // a failure is the decode's to report
	}()
}

// pullRequest is what a decode sends the prefill's side channel.
type pullRequest struct {
	EngineID  string `json:"remote_engine_id"`
	RequestID string `json:"remote_request_id"`
	Blocks    []int  `json:"remote_block_ids"`
}

// vllmPull is the prefill's side channel: it hands a held request's KV (its
// digest) to the decode that names it exactly, and frees the blocks.
func (s *Server) vllmPull(w http.ResponseWriter, r *http.Request) {
	var p pullRequest
	body, err := io.ReadAll(io.LimitReader(r.Body, 1<<20))
	if err == nil {
		err = json.Unmarshal(body, &p)
	}
	if err != nil {
		_ = writeError(w, badRequest("pull: %v", err))
		return
	}
	k := &s.vkv
	k.mu.Lock()
	h := k.held[p.RequestID]
	var e *apiError
	switch {
	case p.EngineID != k.engine:
		e = errorf(http.StatusConflict, "engine %q is not this prefill's (%q)", p.EngineID, k.engine)
	case h == nil:
		e = errorf(http.StatusNotFound, "no KV held for request %q", p.RequestID)
	case !slices.Equal(h.Blocks, p.Blocks):
		e = errorf(http.StatusConflict, "blocks %v are not request %q's %v", p.Blocks, p.RequestID, h.Blocks)
	case h.XRequestID != r.Header.Get("X-Request-Id"):
		e = errorf(http.StatusConflict, "decode's X-Request-Id %q is not the prefill's %q", r.Header.Get("X-Request-Id"), h.XRequestID)
	default:
		h.expiry.Stop()
		delete(k.held, p.RequestID)
	}
	k.mu.Unlock()
	if e != nil {
		_ = writeError(w, e)
		return
	}
	s.writeAny(w, struct {
		Digest string `json:"digest"`
	}{h.digest})
}

// vllmFetch checks a decode's kv_transfer_params and pulls the KV they
// name; it records the pull either way. kv is what moved through kvproxy
// (nil over the side channel).
func (s *Server) vllmFetch(ctx context.Context, r *http.Request, raw json.RawMessage, seqs []sequence) (kv *KVResult, e *apiError) {
	xid := r.Header.Get("X-Request-Id")
	p, e := checkDecodeParams(raw)
	if e == nil {
		if s.cfg.KV != nil {
			kv, e = s.receiveKV(ctx, xid, p, seqs)
		} else {
			e = s.pullKV(ctx, xid, p, vllmDigest(seqs))
		}
	}
	rec := VLLMPull{XRequestID: xid, Params: append(json.RawMessage(nil), raw...), KV: kv}
	if e != nil {
		rec.Error = e.message
	}
	s.vkv.mu.Lock()
	if limit := s.cfg.RecordLimit; limit > 0 { // as many as the requests kept (negative: none)
		if len(s.vkv.pulls) == limit {
			s.vkv.pulls = append(s.vkv.pulls[:0], s.vkv.pulls[1:]...)
		}
		s.vkv.pulls = append(s.vkv.pulls, rec)
	}
	s.vkv.mu.Unlock()
	return kv, e
}

func (k *vllmKV) reset() {
	k.mu.Lock()
	k.pulls = nil
	k.mu.Unlock()
}

// decodeParams are a decode's checked kv_transfer_params.
type decodeParams struct {
	engineID, requestID string
	blocks              []int
	host                string
	port                int
}

func checkDecodeParams(raw json.RawMessage) (*decodeParams, *apiError) {
	if isNull(raw) {
		return nil, badRequest("vllm-decode: the request has no kv_transfer_params (a decode instance needs its prefill's)")
	}
	var p vllmParams
	if err := json.Unmarshal(raw, &p); err != nil {
		return nil, badRequest("kv_transfer_params: %v", err)
	}
	var port int
	perr := json.Unmarshal(p.RemotePort, &port)
	switch {
	case !p.DoRemotePrefill || p.DoRemoteDecode:
		return nil, badRequest("kv_transfer_params: a decode needs do_remote_prefill true and do_remote_decode false")
	case p.RemoteEngineID == nil || *p.RemoteEngineID == "":
		return nil, badRequest("kv_transfer_params: remote_engine_id missing")
	case p.RemoteRequestID == nil || *p.RemoteRequestID == "":
		return nil, badRequest("kv_transfer_params: remote_request_id missing")
	case len(p.RemoteBlockIDs) == 0:
		return nil, badRequest("kv_transfer_params: remote_block_ids missing")
	case p.RemoteHost == nil || *p.RemoteHost == "":
		return nil, badRequest("kv_transfer_params: remote_host missing")
	case perr != nil || port <= 0 || port > 65535:
		return nil, badRequest("kv_transfer_params: remote_port %s is not a port", p.RemotePort)
	case p.TPSize == nil || *p.TPSize < 1:
		return nil, badRequest("kv_transfer_params: tp_size missing")
	}
	return &decodeParams{engineID: *p.RemoteEngineID, requestID: *p.RemoteRequestID, blocks: p.RemoteBlockIDs,
		host: *p.RemoteHost, port: port}, nil
}

// receiveKV has kvproxy bring the request's KV from the prefill's kvproxy
// at remote_host:remote_port into this engine's pool, checked page by page.
// The room is named by remote_request_id, which must be the one the
// prefill made for this X-Request-Id (both legs carry the same).
func (s *Server) receiveKV(ctx context.Context, xid string, p *decodeParams, seqs []sequence) (*KVResult, *apiError) {
	addr := net.JoinHostPort(p.host, strconv.Itoa(p.port))
	if !strings.HasPrefix(p.requestID, "cmpl-"+xid+"-") {
		return nil, errorf(http.StatusInternalServerError, "KV transfer failed: remote_request_id %q was not made for X-Request-Id %q", p.requestID, xid)
	}
	req := vllmKVRequest(p.requestID, seqs)
	req.BootstrapHost, req.BootstrapPort = p.host, p.port
	kv, err := s.cfg.KV.Decode(ctx, req)
	if err != nil {
		status := http.StatusInternalServerError
		var se interface{ HTTPStatus() int } // e.g. KV pool exhausted: 503
		if errors.As(err, &se) {
			status = se.HTTPStatus()
		}
		return nil, errorf(status, "KV transfer failed: from the prefill's kvproxy at %s (room %d): %v", addr, req.Room, err)
	}
	return kv, nil
}
