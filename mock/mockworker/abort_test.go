package mockworker

import (
	"encoding/json"
	"testing"
)

func TestAbortRequestRecorded(t *testing.T) {
	h := start(t, Config{APIKey: "k"})
	if code, _, _ := h.post("/abort_request", `{"rid":"r1"}`); code != 401 {
		t.Fatalf("abort without the key: %d, want 401 (SGLang's api-key rule)", code)
	}
	if code, _, b := h.post("/abort_request", `{"rid":"r1"}`, "Authorization", "Bearer k"); code != 200 {
		t.Fatalf("abort: %d %s", code, b)
	}
	if code, _, _ := h.post("/abort_request", `{"abort_all":true}`, "Authorization", "Bearer k"); code != 200 {
		t.Fatalf("abort_all: %d", code)
	}
	if code, _, _ := h.post("/abort_request", `{"rid":`, "Authorization", "Bearer k"); code != 400 {
		t.Fatalf("bad body: %d, want 400", code)
	}
	got := h.s.Aborts()
	if len(got) != 2 || got[0].RID != "r1" || got[0].AuthHeader != "Bearer k" || !got[1].AbortAll || got[0].UnixNano == 0 {
		t.Fatalf("aborts = %+v", got)
	}
	code, b := h.get("/_mock/aborts")
	var over []RecordedAbort
	if err := json.Unmarshal(b, &over); code != 200 || err != nil || len(over) != 2 || over[0].RID != "r1" {
		t.Fatalf("/_mock/aborts: %d %v %s", code, err, b)
	}
	h.s.Reset()
	if n := len(h.s.Aborts()); n != 0 {
		t.Fatalf("%d aborts after Reset", n)
	}
}
