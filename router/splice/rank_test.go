package splice

import (
	"encoding/json"
	"strings"
	"testing"
)

func decodeObj(t testing.TB, b []byte) map[string]json.RawMessage {
	t.Helper()
	var m map[string]json.RawMessage
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatalf("not a JSON object: %v\n%s", err, b)
	}
	return m
}

// PD with DP ranks, as smg: prefill routed_dp_rank = P; decode
// routed_dp_rank = D and disagg_prefill_dp_rank = P; one bootstrap (the
// same room) and rid on both.
func TestRanksOnTwoLegs(t *testing.T) {
	src := []byte(`{"text":"hi","routed_dp_rank":7,"stream":false}`)
	var info Info
	if err := Inspect(src, &info); err != nil {
		t.Fatal(err)
	}
	ranks := FindRanks(src, &info)
	var pre, dec Body
	pre.Reset(src)
	SetBootstrap(&pre, &info, "h", 8998, 1)
	SetNewRID(&pre)
	pre.CopyTo(&dec)
	SetRank(&pre, &ranks, RoutedDPRank, 2)
	SetRank(&dec, &ranks, RoutedDPRank, 5)
	SetRank(&dec, &ranks, DisaggPrefillDPRank, 2)
	p, d := decodeObj(t, pre.AppendTo(nil)), decodeObj(t, dec.AppendTo(nil))
	if string(p["routed_dp_rank"]) != "2" || p["disagg_prefill_dp_rank"] != nil {
		t.Errorf("prefill ranks %s %s", p["routed_dp_rank"], p["disagg_prefill_dp_rank"])
	}
	if string(d["routed_dp_rank"]) != "5" || string(d["disagg_prefill_dp_rank"]) != "2" {
		t.Errorf("decode ranks %s %s", d["routed_dp_rank"], d["disagg_prefill_dp_rank"])
	}
	for _, k := range []string{"bootstrap_room", "bootstrap_host", "bootstrap_port", "rid", "text", "stream"} {
		if string(p[k]) != string(d[k]) || p[k] == nil {
			t.Errorf("%s: prefill %s, decode %s", k, p[k], d[k])
		}
	}
	// The client's value is replaced in place: key order survives.
	if out := string(pre.AppendTo(nil)); !strings.HasPrefix(out, `{"text":"hi","routed_dp_rank":2,"stream":false,`) {
		t.Errorf("not replaced in place: %s", out)
	}
}

func TestFindRanks(t *testing.T) {
	src := []byte(` { "a":{"routed_dp_rank":9}, "routed_dp_rank" : 12 ,"x":[1],"disagg_prefill_dp_rank":null}`)
	var info Info
	if err := Inspect(src, &info); err != nil || !info.HasRanks {
		t.Fatalf("Inspect: %v, HasRanks %v", err, info.HasRanks)
	}
	r := FindRanks(src, &info)
	if r[DataParallelRank].OK() || string(src[r[RoutedDPRank].Start:r[RoutedDPRank].End]) != "12" ||
		string(src[r[DisaggPrefillDPRank].Start:r[DisaggPrefillDPRank].End]) != "null" {
		t.Errorf("ranks %+v", r)
	}
	plain := []byte(`{"text":"routed_dp_rank","a":{"data_parallel_rank":1}}`)
	if err := Inspect(plain, &info); err != nil || info.HasRanks || FindRanks(plain, &info) != (Ranks{}) {
		t.Errorf("nested or quoted names count as rank fields: %+v", info)
	}
}

// Regular mode, as sglang-router 0.3.x: data_parallel_rank only.
func TestDataParallelRank(t *testing.T) {
	for src, want := range map[string]string{
		`{}`:                            `{"data_parallel_rank":3}`,
		`{"data_parallel_rank":"x"}`:    `{"data_parallel_rank":3}`,
		`{"a":1 , "b":[{"c":null}] }  `: `{"a":1 , "b":[{"c":null}] ,"data_parallel_rank":3}  `,
	} {
		var info Info
		if err := Inspect([]byte(src), &info); err != nil {
			t.Fatal(err)
		}
		ranks := FindRanks([]byte(src), &info)
		var b Body
		b.Reset([]byte(src))
		SetRank(&b, &ranks, DataParallelRank, 3)
		if got := string(b.AppendTo(nil)); got != want {
			t.Errorf("%s: got %s, want %s", src, got, want)
		}
	}
}

func TestCopyToIsIndependent(t *testing.T) {
	src := []byte(`{"x":1}`)
	var info Info
	_ = Inspect(src, &info)
	var ranks Ranks
	var a, b Body
	a.Reset(src)
	SetRank(&a, &ranks, RoutedDPRank, 1)
	a.CopyTo(&b)
	SetRank(&b, &ranks, DisaggPrefillDPRank, 9)
	SetRank(&a, &ranks, DataParallelRank, 4)
	if got := string(a.AppendTo(nil)); got != `{"x":1,"routed_dp_rank":1,"data_parallel_rank":4}` {
		t.Errorf("a = %s", got)
	}
	if got := string(b.AppendTo(nil)); got != `{"x":1,"routed_dp_rank":1,"disagg_prefill_dp_rank":9}` {
		t.Errorf("b = %s", got)
	}
}

// topKeys counts the top-level member names of a JSON object.
func topKeys(t testing.TB, b []byte) map[string]int {
	t.Helper()
	dec := json.NewDecoder(strings.NewReader(string(b)))
	n := map[string]int{}
	depth, wantKey := 0, false
	for {
		tok, err := dec.Token()
		if err != nil {
			return n
		}
		switch v := tok.(type) {
		case json.Delim:
			if v == '{' || v == '[' {
				depth++
				wantKey = depth == 1
			} else {
				depth--
				wantKey = depth == 1 // a nested value ended
			}
		case string:
			if depth == 1 && wantKey {
				n[v]++
				wantKey = false
			} else if depth == 1 {
				wantKey = true
			}
		default:
			if depth == 1 {
				wantKey = true
			}
		}
	}
}

// FuzzRanks: on any valid object, the two PD bodies are valid JSON with
// the ranks set and every other member as the client sent it.
func FuzzRanks(f *testing.F) {
	for _, s := range []string{`{}`, `{"routed_dp_rank":1,"routed_dp_rank":2}`, `{"disagg_prefill_dp_rank":null,"text":"a"}`,
		`{"data_parallel_rank":[1],"bootstrap_room":"r","rid":"x"}`, ` { "a" : { "routed_dp_rank" : 1 } } `} {
		f.Add([]byte(s), uint16(3), uint16(4))
	}
	f.Fuzz(func(t *testing.T, src []byte, p, d uint16) {
		var info Info
		if Inspect(src, &info) != nil {
			return
		}
		var client map[string]json.RawMessage
		if json.Unmarshal(src, &client) != nil {
			return // e.g. invalid UTF-8 Inspect lets through
		}
		if strings.Contains(string(src), `\u`) {
			return // an escaped spelling of a rank name is not one (as for the bootstrap fields)
		}
		ranks, sent := FindRanks(src, &info), topKeys(t, src)
		var pre, dec Body
		pre.Reset(src)
		SetBootstrap(&pre, &info, "h", 1, 1)
		pre.CopyTo(&dec)
		SetRank(&pre, &ranks, RoutedDPRank, int(p))
		SetRank(&dec, &ranks, RoutedDPRank, int(d))
		SetRank(&dec, &ranks, DisaggPrefillDPRank, int(p))
		for _, leg := range []struct {
			b    *Body
			want map[string]int
		}{{&pre, map[string]int{"routed_dp_rank": int(p)}}, {&dec, map[string]int{"routed_dp_rank": int(d), "disagg_prefill_dp_rank": int(p)}}} {
			raw := leg.b.AppendTo(nil)
			out, keys := decodeObj(t, raw), topKeys(t, raw)
			for k, v := range leg.want {
				// The client's (last) value is replaced, not joined by a second
				// member; earlier duplicates stay, and JSON's last one wins.
				if keys[k] != max(sent[k], 1) {
					t.Fatalf("%s appears %d times at the top level, the client sent %d\n%s", k, keys[k], sent[k], raw)
				}
				var n int
				if json.Unmarshal(out[k], &n) != nil || n != v {
					t.Fatalf("%s = %s, want %d\n%s", k, out[k], v, leg.b.AppendTo(nil))
				}
			}
			for k, v := range client {
				if _, set := leg.want[k]; set || strings.HasPrefix(k, "bootstrap_") {
					continue
				}
				if string(out[k]) != string(v) {
					t.Fatalf("%s changed: %s -> %s", k, v, out[k])
				}
			}
		}
	})
}
