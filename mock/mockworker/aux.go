package mockworker

import (
	"math"
	"sort"
	"time"
)

// Deterministic answers for the non-generating model endpoints.

const embeddingDim = 8

// score maps a prompt to a stable value in [0, 1).
func score(p prompt) float64 {
	return float64(Mix(promptSeed(p.text, 0))>>11) / (1 << 53)
}

func (a *answer) embeddings() error {
	type embedding struct {
		Object    string    `json:"object"`
		Embedding []float64 `json:"embedding"`
		Index     int       `json:"index"`
	}
	data := make([]embedding, len(a.seqs))
	for i, sq := range a.seqs {
		// A unit vector derived from the prompt.
		seed := promptSeed(sq.prompt.text, 0)
		v := make([]float64, embeddingDim)
		var norm float64
		for d := range v {
			v[d] = float64(int64(Mix(seed+uint64(d))%vocabSize)-vocabSize/2) / vocabSize
			norm += v[d] * v[d]
		}
		for d := range v {
			v[d] /= math.Sqrt(norm)
		}
		data[i] = embedding{Object: "embedding", Embedding: v, Index: i}
	}
	n := promptTokens(a.seqs)
	return a.writeJSON(map[string]any{
		"object": "list", "data": data, "model": a.model(),
		"usage":     map[string]int{"prompt_tokens": n, "total_tokens": n},
		"worker_id": a.s.workerID,
	})
}

func (a *answer) classify() error {
	type class struct {
		Index      int       `json:"index"`
		Label      string    `json:"label"`
		Probs      []float64 `json:"probs"`
		NumClasses int       `json:"num_classes"`
	}
	data := make([]class, len(a.seqs))
	for i, sq := range a.seqs {
		p := score(sq.prompt)
		label := "LABEL_0"
		if p > 0.5 {
			label = "LABEL_1"
		}
		data[i] = class{Index: i, Label: label, Probs: []float64{1 - p, p}, NumClasses: 2}
	}
	n := promptTokens(a.seqs)
	return a.writeJSON(map[string]any{
		"id": "classify-" + a.s.newID(), "object": "list", "created": time.Now().Unix(), "model": a.model(),
		"data":      data,
		"usage":     map[string]int{"prompt_tokens": n, "completion_tokens": 0, "total_tokens": n},
		"worker_id": a.s.workerID,
	})
}

// rerank answers SGLang's shape: a JSON array sorted by descending score.
func (a *answer) rerank() error {
	type result struct {
		Score    float64        `json:"score"`
		Document string         `json:"document"`
		Index    int            `json:"index"`
		MetaInfo map[string]int `json:"meta_info"`
	}
	out := make([]result, len(a.seqs))
	for i, sq := range a.seqs {
		out[i] = result{Score: score(sq.prompt), Document: a.req.documents[i], Index: i,
			MetaInfo: map[string]int{"prompt_tokens": len(sq.prompt.ids)}}
	}
	sort.SliceStable(out, func(i, j int) bool { return out[i].Score > out[j].Score })
	return a.writeJSON(out)
}

func (a *answer) responses() error {
	if !a.waitAll() {
		return errClientGone
	}
	sq := &a.seqs[0]
	id := a.s.newID()
	return a.writeJSON(map[string]any{
		"id": "resp_" + id, "object": "response", "created_at": time.Now().Unix(), "status": "completed",
		"model": a.model(),
		"output": []map[string]any{{
			"type": "message", "id": "msg_" + id, "status": "completed", "role": "assistant",
			"content": []map[string]any{{"type": "output_text", "text": sq.text, "annotations": []any{}}},
		}},
		"usage": map[string]int{"input_tokens": len(sq.prompt.ids), "output_tokens": len(sq.ids),
			"total_tokens": len(sq.prompt.ids) + len(sq.ids)},
		"worker_id": a.s.workerID,
	})
}
