package mockworker

import (
	"encoding/json"
	"testing"
)

func TestV1Loads(t *testing.T) {
	h := start(t, Config{})
	code, b := h.get("/v1/loads?include=core,queues&dp_rank=0")
	var v struct {
		DPRankCount int `json:"dp_rank_count"`
		Loads       []struct {
			DPRank         *int   `json:"dp_rank"`
			NumUsedTokens  *int64 `json:"num_used_tokens"`
			NumTotalTokens *int64 `json:"num_total_tokens"`
		} `json:"loads"`
		Aggregate map[string]any `json:"aggregate"`
	}
	if err := json.Unmarshal(b, &v); code != 200 || err != nil || v.DPRankCount != 1 || len(v.Loads) != 1 ||
		v.Loads[0].DPRank == nil || v.Loads[0].NumUsedTokens == nil || v.Loads[0].NumTotalTokens == nil || v.Aggregate == nil {
		t.Fatalf("%d %v %s", code, err, b)
	}
	for _, q := range []string{"?include=bogus", "?dp_rank=1", "?dp_rank=x"} {
		if code, b := h.get("/v1/loads" + q); code != 400 {
			t.Errorf("%s: %d %s, want 400", q, code, b)
		}
	}
	if code, _ := h.get("/get_load"); code != 200 {
		t.Fatalf("/get_load %d", code)
	}
	if st := h.s.Stats(); st.V1LoadPolls != 4 || st.GetLoadPolls != 1 {
		t.Errorf("polls %+v, want 4 /v1/loads and 1 /get_load", st)
	}

	old := start(t, Config{NoV1Loads: true})
	if code, _ := old.get("/v1/loads"); code != 404 {
		t.Errorf("--no-v1-loads: /v1/loads %d, want 404", code)
	}
	if code, _ := old.get("/get_load"); code != 200 {
		t.Errorf("--no-v1-loads: /get_load %d", code)
	}
}
