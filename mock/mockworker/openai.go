package mockworker

import "time"

// OpenAI-compatible shapes, as SGLang serves them.

type openaiUsage struct {
	PromptTokens     int `json:"prompt_tokens"`
	CompletionTokens int `json:"completion_tokens"`
	TotalTokens      int `json:"total_tokens"`
}

// openaiResponse is a chat or completions reply, or a chunk of one: the
// two differ only in their choices.
type openaiResponse[C any] struct {
	ID         string       `json:"id"`
	Object     string       `json:"object"`
	Created    int64        `json:"created"`
	Model      string       `json:"model"`
	Choices    []C          `json:"choices"`
	Usage      *openaiUsage `json:"usage,omitempty"`
	KVTransfer any          `json:"kv_transfer,omitempty"`
	WorkerID   string       `json:"worker_id"`
	// KVTransferParams is vLLM's: what a prefill tells the decode (vllm.go).
	KVTransferParams any `json:"kv_transfer_params,omitempty"`
}

type (
	chatResponse       = openaiResponse[chatChoice]
	completionResponse = openaiResponse[completionChoice]
)

type chatChoice struct {
	Index        int           `json:"index"`
	Message      *chatOut      `json:"message,omitempty"`
	Delta        *chatOut      `json:"delta,omitempty"`
	Logprobs     *chatLogprobs `json:"logprobs"`
	FinishReason *string       `json:"finish_reason"`
}

type chatOut struct {
	Role    string  `json:"role,omitempty"`
	Content *string `json:"content,omitempty"`
}

type chatLogprobs struct {
	Content []tokenLogprobOut `json:"content"`
}

type tokenLogprobOut struct {
	Token       string            `json:"token"`
	Logprob     float64           `json:"logprob"`
	Bytes       []int             `json:"bytes"`
	TopLogprobs []tokenLogprobOut `json:"top_logprobs,omitempty"`
}

type completionChoice struct {
	Index        int                 `json:"index"`
	Text         string              `json:"text"`
	Logprobs     *completionLogprobs `json:"logprobs"`
	FinishReason *string             `json:"finish_reason"`
}

type completionLogprobs struct {
	Tokens        []string             `json:"tokens"`
	TokenLogprobs []float64            `json:"token_logprobs"`
	TopLogprobs   []map[string]float64 `json:"top_logprobs"`
	TextOffset    []int                `json:"text_offset"`
}

var finishLength = "length"

func (a *answer) usage() *openaiUsage {
	u := &openaiUsage{PromptTokens: promptTokens(a.seqs)}
	for _, sq := range a.seqs {
		u.CompletionTokens += len(sq.ids)
	}
	u.TotalTokens = u.PromptTokens + u.CompletionTokens
	return u
}

// tokenLogprob describes output token ids[k] with top alternatives.
func (a *answer) tokenLogprob(id int) tokenLogprobOut {
	t := tokenText(id)
	out := tokenLogprobOut{Token: t, Logprob: tokenLogprob(id), Bytes: utf8Bytes(t)}
	for j := range a.req.topLogprobs {
		alt := id
		if j > 0 {
			alt = (id + j*7919) % vocabSize
		}
		at := tokenText(alt)
		out.TopLogprobs = append(out.TopLogprobs, tokenLogprobOut{Token: at, Logprob: tokenLogprob(id) - float64(j), Bytes: utf8Bytes(at)})
	}
	return out
}

func utf8Bytes(s string) []int {
	b := make([]int, len(s))
	for i := range len(s) {
		b[i] = int(s[i])
	}
	return b
}

func (a *answer) chatLogprobs(ids []int) *chatLogprobs {
	if !a.req.logprobs {
		return nil
	}
	lp := &chatLogprobs{Content: make([]tokenLogprobOut, len(ids))}
	for i, id := range ids {
		lp.Content[i] = a.tokenLogprob(id)
	}
	return lp
}

func (a *answer) completionLogprobs(sq *sequence, from, to int) *completionLogprobs {
	if !a.req.logprobs {
		return nil
	}
	lp := &completionLogprobs{}
	for k := from; k < to; k++ {
		id := sq.ids[k]
		lp.Tokens = append(lp.Tokens, tokenText(id))
		lp.TokenLogprobs = append(lp.TokenLogprobs, tokenLogprob(id))
		lp.TextOffset = append(lp.TextOffset, sq.offs[k])
		if a.req.topLogprobs > 0 {
			top := map[string]float64{}
			for _, t := range a.tokenLogprob(id).TopLogprobs {
				top[t.Token] = t.Logprob
			}
			lp.TopLogprobs = append(lp.TopLogprobs, top)
		}
	}
	return lp
}

func (a *answer) chat() error {
	base := chatResponse{ID: "chatcmpl-" + a.s.newID(), Created: time.Now().Unix(), Model: a.model(), WorkerID: a.s.workerID}
	if a.req.stream {
		base.Object = "chat.completion.chunk"
		return a.chatStream(base)
	}
	if !a.waitAll() {
		return errClientGone
	}
	base.Object = "chat.completion"
	for i := range a.seqs {
		sq := &a.seqs[i]
		base.Choices = append(base.Choices, chatChoice{
			Index:        sq.choice,
			Message:      &chatOut{Role: "assistant", Content: &sq.text},
			Logprobs:     a.chatLogprobs(sq.ids),
			FinishReason: &finishLength,
		})
	}
	base.Usage = a.usage()
	base.KVTransfer, base.KVTransferParams = a.kvTopLevel(), a.vllmParams
	return a.writeJSON(base)
}

// chatStream: per choice a role chunk, one content delta per token and a
// final chunk with finish_reason (openaiStream).
func (a *answer) chatStream(base chatResponse) error {
	empty := ""
	return openaiStream(a, base, choiceShape[chatChoice]{
		whole: func(sq *sequence) chatChoice {
			return chatChoice{Index: sq.choice, Delta: &chatOut{Role: "assistant", Content: &sq.text},
				Logprobs: a.chatLogprobs(sq.ids), FinishReason: &finishLength}
		},
		opening: func(sq *sequence) chatChoice {
			return chatChoice{Index: sq.choice, Delta: &chatOut{Role: "assistant", Content: &empty}}
		},
		token: func(sq *sequence, k int) chatChoice {
			tok := tokenText(sq.ids[k])
			return chatChoice{Index: sq.choice, Delta: &chatOut{Content: &tok}, Logprobs: a.chatLogprobs(sq.ids[k : k+1])}
		},
		end: func(sq *sequence) chatChoice {
			return chatChoice{Index: sq.choice, Delta: &chatOut{}, FinishReason: &finishLength}
		},
	})
}

func (a *answer) completions() error {
	base := completionResponse{ID: "cmpl-" + a.s.newID(), Object: "text_completion", Created: time.Now().Unix(), Model: a.model(), WorkerID: a.s.workerID}
	if a.req.stream {
		return a.completionsStream(base)
	}
	if !a.waitAll() {
		return errClientGone
	}
	for i := range a.seqs {
		sq := &a.seqs[i]
		base.Choices = append(base.Choices, completionChoice{Index: sq.choice, Text: sq.text,
			Logprobs: a.completionLogprobs(sq, 0, len(sq.ids)), FinishReason: &finishLength})
	}
	base.Usage = a.usage()
	base.KVTransfer, base.KVTransferParams = a.kvTopLevel(), a.vllmParams
	return a.writeJSON(base)
}

// completionsStream: per choice one text delta per token and a final
// chunk with finish_reason (openaiStream).
func (a *answer) completionsStream(base completionResponse) error {
	return openaiStream(a, base, choiceShape[completionChoice]{
		whole: func(sq *sequence) completionChoice {
			return completionChoice{Index: sq.choice, Text: sq.text,
				Logprobs: a.completionLogprobs(sq, 0, len(sq.ids)), FinishReason: &finishLength}
		},
		token: func(sq *sequence, k int) completionChoice {
			return completionChoice{Index: sq.choice, Text: tokenText(sq.ids[k]), Logprobs: a.completionLogprobs(sq, k, k+1)}
		},
		end: func(sq *sequence) completionChoice {
			return completionChoice{Index: sq.choice, FinishReason: &finishLength}
		},
	})
}

// choiceShape is how a stream's choices are made of a sequence: all of
// it at once (prefill's), an opening chunk if the shape has one, one token,
// the finish.
type choiceShape[C any] struct {
	whole   func(sq *sequence) C
	opening func(sq *sequence) C // nil: the shape has none
	token   func(sq *sequence, k int) C
	end     func(sq *sequence) C
}

// openaiStream sends a chat or completions stream: one chunk per choice
// piece, then a usage chunk when asked. kv_transfer rides on the last
// chunk. The prefill role sends a single chunk per choice.
func openaiStream[C any](a *answer, base openaiResponse[C], shape choiceShape[C]) error {
	ev := a.sse()
	kv := a.kvTopLevel()
	emit := func(c C, last bool) error {
		chunk := base
		chunk.Choices = []C{c}
		if last {
			chunk.KVTransfer = kv
			if a.s.cfg.Role == RolePrefill && a.req.includeUsage {
				chunk.Usage = a.usage()
			}
		}
		return ev.send(&chunk)
	}
	if a.s.cfg.Role == RolePrefill {
		for i := range a.seqs {
			if err := emit(shape.whole(&a.seqs[i]), i == len(a.seqs)-1); err != nil {
				return err
			}
		}
		return ev.done()
	}
	t0 := time.Now()
	steps, lastSeq := a.steps()
	for k := range steps {
		if !a.pace(t0, k) {
			return errClientGone
		}
		for i := range a.seqs {
			sq := &a.seqs[i]
			if k == 0 && shape.opening != nil {
				if err := emit(shape.opening(sq), false); err != nil {
					return err
				}
			}
			if k < len(sq.ids) {
				if err := emit(shape.token(sq, k), false); err != nil {
					return err
				}
			}
			if k == max(len(sq.ids), 1)-1 {
				last := !a.req.includeUsage && k == steps-1 && i == lastSeq
				if err := emit(shape.end(sq), last); err != nil {
					return err
				}
			}
		}
	}
	if a.req.includeUsage {
		chunk := base
		chunk.Choices, chunk.Usage, chunk.KVTransfer = []C{}, a.usage(), kv
		if err := ev.send(&chunk); err != nil {
			return err
		}
	}
	return ev.done()
}
