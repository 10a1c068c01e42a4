package mockworker

import (
	"encoding/json"
	"net/http"
	"reflect"
	"strings"
	"testing"
	"time"
)

func TestRanksRecordedAndCounted(t *testing.T) {
	h := start(t, Config{Engine: EngineInfo{DPSize: 4}})
	for _, body := range []string{
		`{"text":"a","routed_dp_rank":2}`,
		`{"text":"a","data_parallel_rank":3}`,
		`{"text":"a","routed_dp_rank":1,"data_parallel_rank":3}`, // routed wins, as in SGLang
		`{"text":"a","disagg_prefill_dp_rank":3}`,                // no routed rank: rank 0
	} {
		if code, _, b := h.post("/generate", body); code != 200 {
			t.Fatalf("%s: %d %s", body, code, b)
		}
	}
	recs := h.s.Requests()
	var got []int
	for _, r := range recs {
		got = append(got, r.DPRank)
	}
	if want := []int{2, 3, 1, 0}; !reflect.DeepEqual(got, want) {
		t.Errorf("ranks run %v, want %v", got, want)
	}
	if string(recs[2].RoutedDPRank) != "1" || string(recs[2].DataParallelRank) != "3" || recs[2].DisaggPrefillDPRank != nil {
		t.Errorf("raw fields %+v", recs[2])
	}
	if string(recs[3].DisaggPrefillDPRank) != "3" || recs[3].RoutedDPRank != nil {
		t.Errorf("raw fields %+v", recs[3])
	}
	if st := h.s.Stats(); !reflect.DeepEqual(st.RankRequests, []int64{1, 1, 1, 1}) {
		t.Errorf("rank_requests %v", st.RankRequests)
	}
	_, b := h.get("/_mock/stats")
	if !strings.Contains(string(b), `"rank_requests":[1,1,1,1]`) {
		t.Errorf("/_mock/stats %s", b)
	}
	_, b = h.get("/_mock/requests")
	if !strings.Contains(string(b), `"routed_dp_rank":2`) || !strings.Contains(string(b), `"dp_rank":3`) {
		t.Errorf("/_mock/requests %s", b)
	}
}

func TestRanksValidatedAsSGLang(t *testing.T) {
	h := start(t, Config{Engine: EngineInfo{DPSize: 2}})
	for _, body := range []string{
		`{"text":"a","routed_dp_rank":2}`, `{"text":"a","routed_dp_rank":-1}`, `{"text":"a","data_parallel_rank":2}`,
		`{"text":"a","routed_dp_rank":"1"}`, `{"text":"a","routed_dp_rank":1.0}`, `{"text":"a","disagg_prefill_dp_rank":-3}`,
	} {
		code, _, b := h.post("/generate", body)
		if code != 400 || !strings.Contains(string(b), "rank") {
			t.Errorf("%s: %d %s, want 400 naming the rank", body, code, b)
		}
	}
	if code, _, b := h.post("/generate", `{"text":"a","routed_dp_rank":null,"data_parallel_rank":1}`); code != 200 {
		t.Errorf("null routed rank: %d %s", code, b)
	}
}

func TestLoadsPerRank(t *testing.T) {
	h := start(t, Config{Engine: EngineInfo{DPSize: 3}, PrefillDelay: time.Hour})
	done := make(chan struct{})
	go func() {
		defer close(done)
		req, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, h.s.URL()+"/generate",
			strings.NewReader(`{"text":"a b c","sampling_params":{"max_new_tokens":2},"routed_dp_rank":2}`))
		if resp, err := h.client.Do(req); err == nil {
			resp.Body.Close()
		}
	}()
	waitFor(t, "request on rank 2", func() bool { return h.s.Stats().RankRequests[2] == 1 })
	var v1 struct {
		Count int `json:"dp_rank_count"`
		Loads []struct {
			Rank   int `json:"dp_rank"`
			Reqs   int `json:"num_running_reqs"`
			Tokens int `json:"num_total_tokens"`
		} `json:"loads"`
	}
	_, b := h.get("/v1/loads?include=core")
	if err := json.Unmarshal(b, &v1); err != nil || v1.Count != 3 || len(v1.Loads) != 3 {
		t.Fatalf("/v1/loads %s", b)
	}
	for i, l := range v1.Loads {
		wantReqs, wantTokens := 0, 0
		if i == 2 {
			wantReqs, wantTokens = 1, 5
		}
		if l.Rank != i || l.Reqs != wantReqs || l.Tokens != wantTokens {
			t.Errorf("rank %d: %+v", i, l)
		}
	}
	_, b = h.get("/v1/loads?include=core&dp_rank=2")
	if err := json.Unmarshal(b, &v1); err != nil || len(v1.Loads) != 1 || v1.Loads[0].Rank != 2 || v1.Loads[0].Tokens != 5 {
		t.Errorf("/v1/loads?dp_rank=2 %s", b)
	}
	if code, b := h.get("/v1/loads?dp_rank=3"); code != 400 {
		t.Errorf("dp_rank=3 of 3: %d %s", code, b)
	}
	_, b = h.get("/get_load")
	if !strings.Contains(string(b), `{"dp_rank":2,"num_reqs":1,"num_tokens":5,"num_waiting_reqs":0}`) ||
		!strings.Contains(string(b), `{"dp_rank":0,"num_reqs":0,"num_tokens":0,"num_waiting_reqs":0}`) {
		t.Errorf("/get_load %s", b)
	}
	h.s.Close()
	<-done
}

func TestServerInfoKnobs(t *testing.T) {
	h := start(t, Config{Engine: EngineInfo{DPSize: 8}, NoServerInfo: true})
	if code, _ := h.get("/server_info"); code != 404 {
		t.Errorf("/server_info %d, want 404", code)
	}
	if _, b := h.get("/get_server_info"); !strings.Contains(string(b), `"dp_size":8`) {
		t.Errorf("/get_server_info %s", b)
	}
	n := start(t, Config{NoDPSize: true})
	for _, p := range []string{"/server_info", "/get_server_info"} {
		if code, b := n.get(p); code != 200 || strings.Contains(string(b), "dp_size") {
			t.Errorf("%s: %d %s, want no dp_size", p, code, b)
		}
	}
	if _, err := ParseFlags("m", []string{"--port", "0", "--dp-size", "2000"}, new(strings.Builder)); err == nil {
		t.Error("dp-size 2000 accepted")
	}
	c, err := ParseFlags("m", []string{"--port", "0", "--dp-size", "4", "--no-server-info", "--no-dp-size"}, new(strings.Builder))
	if err != nil || c.Engine.DPSize != 4 || !c.NoServerInfo || !c.NoDPSize {
		t.Errorf("flags %+v %v", c, err)
	}
}

func TestFailDPRank(t *testing.T) {
	one := 1
	h := start(t, Config{Engine: EngineInfo{DPSize: 2}, FailDPRank: &one})
	if code, _, b := h.post("/generate", `{"text":"a","routed_dp_rank":1}`); code != 500 || !strings.Contains(string(b), "fail-dp-rank") {
		t.Errorf("rank 1: %d %s", code, b)
	}
	if code, _, b := h.post("/generate", `{"text":"a","routed_dp_rank":0}`); code != 200 {
		t.Errorf("rank 0: %d %s", code, b)
	}
	c, err := ParseFlags("m", []string{"--port", "0", "--fail-dp-rank", "3"}, new(strings.Builder))
	if err != nil || c.FailDPRank == nil || *c.FailDPRank != 3 {
		t.Errorf("flag: %v %v", c.FailDPRank, err)
	}
	if c, _ := ParseFlags("m", []string{"--port", "0"}, new(strings.Builder)); c.FailDPRank != nil {
		t.Error("fail-dp-rank set by default")
	}
}
