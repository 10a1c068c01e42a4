package mockworker

import "time"

// SGLang's native /generate shapes.

type genOut struct {
	Text      string  `json:"text"`
	OutputIDs []int   `json:"output_ids"`
	MetaInfo  genMeta `json:"meta_info"`
	Index     *int    `json:"index,omitempty"` // batch streams only
	WorkerID  string  `json:"worker_id"`
}

type genMeta struct {
	ID                  string        `json:"id"`
	FinishReason        *finishReason `json:"finish_reason"`
	PromptTokens        int           `json:"prompt_tokens"`
	CompletionTokens    int           `json:"completion_tokens"`
	CachedTokens        int           `json:"cached_tokens"`
	E2ELatency          float64       `json:"e2e_latency"`
	InputTokenLogprobs  *logprobList  `json:"input_token_logprobs,omitempty"`
	OutputTokenLogprobs *logprobList  `json:"output_token_logprobs,omitempty"`
	KVTransfer          *KVResult     `json:"kv_transfer,omitempty"`
}

type finishReason struct {
	Type   string `json:"type"`
	Length int    `json:"length"`
}

// inputLogprobs: the whole prompt in the prefill and regular roles; only the
// last prompt token in the decode role, so a router's prefill++decode merge
// is observable.
func (a *answer) inputLogprobs(sq *sequence) *logprobList {
	ids := sq.prompt.ids
	if a.s.cfg.Role == RoleDecode {
		if len(ids) > 0 {
			ids = ids[len(ids)-1:]
		}
		return &logprobList{ids: ids}
	}
	return &logprobList{ids: ids, firstNull: true}
}

// genChunk is item sq's state after k tokens.
func (a *answer) genChunk(sq *sequence, id string, k int, final bool) genOut {
	out := genOut{
		Text:      sq.textAt(k),
		OutputIDs: sq.ids[:k],
		MetaInfo: genMeta{
			ID:               id,
			PromptTokens:     len(sq.prompt.ids),
			CompletionTokens: k,
			E2ELatency:       time.Since(a.start).Seconds(),
		},
		WorkerID: a.s.workerID,
	}
	if final {
		out.MetaInfo.FinishReason = &finishReason{Type: "length", Length: k}
		out.MetaInfo.KVTransfer = a.kvFor(sq)
	}
	if sq.logprob {
		out.MetaInfo.InputTokenLogprobs = a.inputLogprobs(sq)
		out.MetaInfo.OutputTokenLogprobs = &logprobList{ids: sq.ids[:k]}
	}
	return out
}

func (a *answer) generate() error {
	ids := make([]string, len(a.seqs))
	for i := range ids {
		ids[i] = a.s.newID()
	}
	if a.req.stream {
		return a.generateStream(ids)
	}
	if !a.waitAll() {
		return errClientGone
	}
	outs := make([]genOut, len(a.seqs))
	for i := range a.seqs {
		outs[i] = a.genChunk(&a.seqs[i], ids[i], len(a.seqs[i].ids), true)
	}
	if a.req.batch {
		return a.writeJSON(outs)
	}
	return a.writeJSON(outs[0])
}

// generateStream sends, per token step, one chunk per unfinished item with
// its cumulative text (SGLang's default, non-incremental streaming), then
// [DONE]. An item with no tokens still gets one final chunk.
func (a *answer) generateStream(ids []string) error {
	ev := a.sse()
	t0 := time.Now()
	steps, _ := a.steps()
	for k := range steps {
		if !a.pace(t0, k) {
			return errClientGone
		}
		for i := range a.seqs {
			sq := &a.seqs[i]
			n := len(sq.ids)
			if k >= max(n, 1) {
				continue
			}
			c := a.genChunk(sq, ids[i], min(k+1, n), k == max(n, 1)-1)
			if a.req.batch {
				c.Index = &i
			}
			if err := ev.send(c); err != nil {
				return err
			}
		}
	}
	return ev.done()
}
