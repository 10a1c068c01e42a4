package mockworker

import (
	"cmp"
	"context"
	"encoding/json"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// sequence is one item's planned output.
type sequence struct {
	*genItem
	ids  []int  // output token ids
	text string // full output text
	offs []int  // offs[k] = len(text) after k tokens
}

func (s *sequence) textAt(k int) string { return s.text[:s.offs[k]] }

// sequences plans every item's output: Config.Tokens lowered by the request,
// exactly one token in the prefill role.
func (s *Server) sequences(req *request) []sequence {
	seqs := make([]sequence, len(req.items))
	for i := range req.items {
		it := &req.items[i]
		n := 0
		if req.ep.generates() || req.ep == epResponses {
			n = s.cfg.Tokens
			if it.limit >= 0 && it.limit < n {
				n = it.limit
			}
			if s.cfg.Role == RolePrefill && req.ep.generates() {
				n = 1
			}
		}
		ids := outputIDs(promptSeed(it.prompt.text, it.choice), n)
		var b strings.Builder
		offs := make([]int, n+1)
		for k, id := range ids {
			b.WriteString(tokenText(id))
			offs[k+1] = b.Len()
		}
		seqs[i] = sequence{genItem: it, ids: ids, text: b.String(), offs: offs}
	}
	return seqs
}

// promptTokens counts each distinct prompt once (n choices share one).
func promptTokens(seqs []sequence) int {
	n := 0
	for _, sq := range seqs {
		if sq.firstChoice {
			n += len(sq.prompt.ids)
		}
	}
	return n
}

// answer writes one generation response.
type answer struct {
	s     *Server
	w     http.ResponseWriter
	ctx   context.Context
	req   *request
	seqs  []sequence
	kv    []*KVResult
	start time.Time
	ev    *sse // a stream's events once its head went out early, else nil
	// vllmParams is a vllm-prefill's kv_transfer_params for its reply (vllm.go).
	vllmParams any
}

func (a *answer) model() string {
	if a.req.model != "" {
		return a.req.model
	}
	return a.s.cfg.Model
}

// steps is the number of streaming steps (at least one, so an item with no
// tokens still gets its final chunk) and lastSeq the item finishing last.
func (a *answer) steps() (steps, lastSeq int) {
	steps = max(a.maxTokens(), 1)
	for i, sq := range a.seqs {
		if max(len(sq.ids), 1) == steps {
			lastSeq = i
		}
	}
	return steps, lastSeq
}

func (a *answer) maxTokens() int {
	n := 0
	for _, sq := range a.seqs {
		n = max(n, len(sq.ids))
	}
	return n
}

// pace waits until token k is due: token 0 right away (the prefill delay is
// already spent), then one TokenDelay per token, on a fixed schedule so
// delays do not drift.
func (a *answer) pace(t0 time.Time, k int) bool {
	if k == 0 || a.s.cfg.TokenDelay <= 0 {
		return a.ctx.Err() == nil
	}
	return sleep(a.ctx, time.Until(t0.Add(time.Duration(k)*a.s.cfg.TokenDelay)))
}

// waitAll is the non-streaming equivalent of pacing every token.
func (a *answer) waitAll() bool {
	return sleep(a.ctx, time.Duration(max(a.maxTokens()-1, 0))*a.s.cfg.TokenDelay)
}

// kvFor is the KV result of one item (for /generate's meta_info).
func (a *answer) kvFor(sq *sequence) *KVResult {
	if a.kv == nil {
		return nil
	}
	return a.kv[a.req.entryOf(sq.genItem)]
}

// kvTopLevel is the OpenAI routes' kv_transfer: an object for scalar
// bootstrap fields, an array for arrays; nil when nothing to report.
func (a *answer) kvTopLevel() any {
	if a.kv == nil {
		return nil
	}
	if !a.req.bootArray {
		if a.kv[0] == nil {
			return nil
		}
		return a.kv[0]
	}
	for _, r := range a.kv {
		if r != nil {
			return a.kv
		}
	}
	return nil
}

func (a *answer) writeJSON(v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return writeError(a.w, errorf(http.StatusInternalServerError, "encoding response: %v", err))
	}
	return writeJSONBytes(a.w, http.StatusOK, b)
}

// sse writes Server-Sent Events: "data: {json}\n\n", flushed per event.
type sse struct {
	w       http.ResponseWriter
	rc      *http.ResponseController
	buf     []byte
	started bool
}

func (a *answer) sse() *sse { return cmp.Or(a.ev, newSSE(a.w)) }

func newSSE(w http.ResponseWriter) *sse { return &sse{w: w, rc: http.NewResponseController(w)} }

func (e *sse) send(v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return e.write(b)
}

func (e *sse) done() error { return e.write([]byte("[DONE]")) }

// head sends the stream's 200 and headers now.
func (e *sse) head() error {
	e.writeHead()
	return e.rc.Flush()
}

func (e *sse) writeHead() {
	if !e.started {
		e.started = true
		h := e.w.Header()
		h.Set("Content-Type", "text/event-stream")
		h.Set("Cache-Control", "no-cache")
		e.w.WriteHeader(http.StatusOK)
	}
}

func (e *sse) write(payload []byte) error {
	e.writeHead()
	e.buf = append(append(append(e.buf[:0], "data: "...), payload...), "\n\n"...)
	if _, err := e.w.Write(e.buf); err != nil {
		return err
	}
	return e.rc.Flush()
}

// logprobList marshals SGLang's [[logprob, token_id, null], ...]; with
// firstNull the first entry's logprob is null, as for a prompt's first token.
type logprobList struct {
	ids       []int
	firstNull bool
}

func (l *logprobList) MarshalJSON() ([]byte, error) {
	b := make([]byte, 0, 2+len(l.ids)*24)
	b = append(b, '[')
	for i, id := range l.ids {
		if i > 0 {
			b = append(b, ',')
		}
		b = append(b, '[')
		if i == 0 && l.firstNull {
			b = append(b, "null"...)
		} else {
			b = strconv.AppendFloat(b, tokenLogprob(id), 'f', -1, 64)
		}
		b = append(b, ',')
		b = strconv.AppendInt(b, int64(id), 10)
		b = append(b, ",null]"...)
	}
	return append(b, ']'), nil
}
