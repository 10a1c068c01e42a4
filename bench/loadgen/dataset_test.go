package loadgen

import (
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func seeded() *rand.Rand { return rand.New(rand.NewPCG(7, 7)) }

func TestRandomPrompts(t *testing.T) {
	ps := RandomPrompts(seeded(), 500, 100, 40, 0.5)
	if len(ps) != 500 {
		t.Fatalf("%d prompts", len(ps))
	}
	seenMin, seenMax := false, false
	for _, p := range ps {
		if p.InputLen < 50 || p.InputLen > 100 || p.OutputLen < 20 || p.OutputLen > 40 {
			t.Fatalf("lengths %d/%d outside [50,100]/[20,40]", p.InputLen, p.OutputLen)
		}
		if n := len(strings.Fields(p.Text)); n != p.InputLen {
			t.Fatalf("text has %d words, InputLen %d", n, p.InputLen)
		}
		seenMin = seenMin || p.InputLen == 50
		seenMax = seenMax || p.InputLen == 100
	}
	if !seenMin || !seenMax {
		t.Errorf("500 draws never reached an end of [50,100]: min %v max %v", seenMin, seenMax)
	}
	for _, p := range RandomPrompts(seeded(), 20, 64, 8, 1) {
		if p.InputLen != 64 || p.OutputLen != 8 {
			t.Fatalf("ratio 1 must give exact lengths, got %d/%d", p.InputLen, p.OutputLen)
		}
	}
	if a, b := RandomPrompts(seeded(), 3, 10, 5, 0), RandomPrompts(seeded(), 3, 10, 5, 0); a[2] != b[2] {
		t.Error("the same seed must give the same prompts")
	}
}

func TestSharedPrefixPrompts(t *testing.T) {
	const groups, per, sys, q = 4, 5, 30, 7
	ps := SharedPrefixPrompts(seeded(), groups, per, sys, q, 16)
	if len(ps) != groups*per {
		t.Fatalf("%d prompts, want %d", len(ps), groups*per)
	}
	byPrefix := map[string]int{}
	for _, p := range ps {
		prefix, question, ok := strings.Cut(p.Text, "\n\n")
		if !ok || len(strings.Fields(prefix)) != sys || len(strings.Fields(question)) != q {
			t.Fatalf("prompt is not %d system words, a blank line, %d question words: %q", sys, q, p.Text)
		}
		if p.InputLen != sys+q || p.OutputLen != 16 {
			t.Fatalf("lengths %d/%d", p.InputLen, p.OutputLen)
		}
		byPrefix[prefix]++
	}
	if len(byPrefix) != groups {
		t.Fatalf("%d distinct system prompts, want %d", len(byPrefix), groups)
	}
	for _, n := range byPrefix {
		if n != per {
			t.Fatalf("a group has %d prompts, want %d", n, per)
		}
	}
	first, _, _ := strings.Cut(ps[0].Text, "\n\n")
	sameRun := 0
	for _, p := range ps[:per] {
		if strings.HasPrefix(p.Text, first) {
			sameRun++
		}
	}
	if sameRun == per {
		t.Error("prompts are not shuffled across groups")
	}
}

func TestReadShareGPT(t *testing.T) {
	long := strings.Repeat("w ", 1100)
	src := `[
	 {"id":"1","conversations":[{"from":"human","value":"one two three"},{"from":"gpt","value":"a b c d"}]},
	 {"id":"2","conversations":[{"from":"human","value":"lonely"}]},
	 {"id":"3","conversations":[{"from":"human","value":"hi"},{"from":"gpt","value":"x"}]},
	 {"id":"4","messages":[{"role":"user","content":"four five"},{"role":"assistant","content":"ok ok ok"}]},
	 {"id":"5","conversations":[{"from":"human","value":"` + long + `"},{"from":"gpt","value":"fine fine"}]},
	 {"id":"6","conversation":[{"role":"user","content":"six seven eight"},{"role":"assistant","content":"y y"}]}
	]`
	ps, err := ReadShareGPT(seeded(), strings.NewReader(src), 10, 0)
	if err != nil {
		t.Fatal(err)
	}
	// 2 has one turn, 3 has a 1-token reply, 5 is over 1024 tokens.
	got := map[string][2]int{}
	for _, p := range ps {
		got[p.Text] = [2]int{p.InputLen, p.OutputLen}
	}
	want := map[string][2]int{"one two three": {3, 4}, "four five": {2, 3}, "six seven eight": {3, 2}}
	if len(got) != len(want) {
		t.Fatalf("got %v, want %v", got, want)
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%q: got %v, want %v", k, got[k], v)
		}
	}

	// A fixed output length replaces the reply's and lifts the length limits; n caps the count.
	ps, err = ReadShareGPT(seeded(), strings.NewReader(src), 4, 50)
	if err != nil || len(ps) != 4 {
		t.Fatalf("got %d prompts, %v", len(ps), err)
	}
	for _, p := range ps {
		if p.OutputLen != 50 {
			t.Errorf("output len %d, want 50", p.OutputLen)
		}
	}
	for _, bad := range []string{`{"not":"a list"}`, `[{"conversations":[{"value":"a"}]}]`, `[{"conversations":3}]`} {
		if _, err := ReadShareGPT(seeded(), strings.NewReader(bad), 10, 0); err == nil {
			t.Errorf("%s: want an error", bad)
		}
	}
}

func TestReadTrace(t *testing.T) {
	src := `{"timestamp": 1000, "input_len": 12, "output_len": 3}

{"timestamp": 1500, "input_length": 5, "output_length": 9, "hash_ids": [1, 2]}
{"timestamp": 3000.5, "input_len": 1, "output_len": 1}
{"timestamp": 4000, "input_len": 2, "output_len": 2}
`
	ps, err := ReadTrace(seeded(), strings.NewReader(src), 3, 2)
	if err != nil {
		t.Fatal(err)
	}
	want := []Prompt{{InputLen: 12, OutputLen: 3, At: 0}, {InputLen: 5, OutputLen: 9, At: 250 * time.Millisecond},
		{InputLen: 1, OutputLen: 1, At: 1000250 * time.Microsecond}}
	if len(ps) != len(want) {
		t.Fatalf("%d prompts, want %d (n caps the trace)", len(ps), len(want))
	}
	for i, w := range want {
		p := ps[i]
		if p.InputLen != w.InputLen || p.OutputLen != w.OutputLen || p.At != w.At || len(strings.Fields(p.Text)) != w.InputLen {
			t.Errorf("line %d: got %d/%d at %v, want %d/%d at %v", i, p.InputLen, p.OutputLen, p.At, w.InputLen, w.OutputLen, w.At)
		}
	}
	for _, bad := range []string{
		`{"timestamp": 1, "input_len": 0, "output_len": 3}`,
		`{"input_len": 4, "output_len": 3}`,
		"{\"timestamp\": 5, \"input_len\": 1, \"output_len\": 1}\n{\"timestamp\": 4, \"input_len\": 1, \"output_len\": 1}",
		`not json`,
		``,
	} {
		if _, err := ReadTrace(seeded(), strings.NewReader(bad), 10, 1); err == nil {
			t.Errorf("%q: want an error", bad)
		}
	}
}

func TestDatasetConfigLoad(t *testing.T) {
	dir := t.TempDir()
	trace := filepath.Join(dir, "t.jsonl")
	if err := os.WriteFile(trace, []byte(`{"timestamp":0,"input_len":3,"output_len":2}`+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		c    DatasetConfig
		want int
	}{
		{DatasetConfig{Name: "random", NumPrompts: 7, RandomInputLen: 5, RandomOutputLen: 5}, 7},
		{DatasetConfig{Name: "generated-shared-prefix", NumPrompts: 1, GSPNumGroups: 2, GSPPromptsPerGroup: 3,
			GSPSystemPromptLen: 4, GSPQuestionLen: 2, GSPOutputLen: 2}, 6},
		{DatasetConfig{Name: "trace", Path: trace, NumPrompts: 10, TraceSpeedup: 1}, 1},
	}
	for _, c := range cases {
		ps, err := c.c.Load(seeded())
		if err != nil || len(ps) != c.want {
			t.Errorf("%s: %d prompts, %v; want %d", c.c.Name, len(ps), err, c.want)
		}
		if len(c.c.Args()) == 0 {
			t.Errorf("%s: no report args", c.c.Name)
		}
	}
	for _, c := range []DatasetConfig{{Name: "sharegpt"}, {Name: "nope"}, {Name: "trace", Path: filepath.Join(dir, "missing")}} {
		if _, err := c.Load(seeded()); err == nil {
			t.Errorf("%+v: want an error", c)
		}
	}
}
