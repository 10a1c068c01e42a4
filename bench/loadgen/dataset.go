// Package loadgen is pdbench's engine: datasets, request senders, arrival schedules, metrics and
// reports, with metric definitions taken from sglang.bench_serving.
//
// Token lengths are approximated by words: a prompt of N tokens is N words drawn from a vocabulary
// of short common English words (one token each in the usual BPE tokenizers), and the length of a
// ShareGPT text is its number of whitespace-separated words. pdbench ships no tokenizer, so input
// lengths are estimates; output lengths come from the server's usage counts when it sends them.
package loadgen

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"strings"
	"time"
)

// Prompt is one request to send: the text, its length in tokens (words), how many tokens to ask for,
// and for trace replay when to send it, relative to the first request.
type Prompt struct {
	Text      string
	InputLen  int
	OutputLen int
	At        time.Duration
}

// vocab holds words that are single tokens in common tokenizers, so that N words ≈ N tokens.
var vocab = strings.Fields(`the of and to in is was for on are with as at be by this had not but from
or have an they which one you were her all she there would their we him been has when who will more no
if out so said what up its about into than them can only other new some could time these two may then do
first any my now such like our over man me even most made after also did many before must through back
years where much your way well down should because each just those people how too little state good very
make world still own see men work long get here between both life being under never day same another know
while last might us great old year off come since against go came right used take three states himself
few house use during without again place around however home small found thought went say part once high
upon school every don does got united left number course war until always away something fact though water
less public put think almost hand enough far took head yet government system better set told nothing night
end why called didn eyes find going look asked later knew point next program city business give group toward
young let room side social present given several order national possible rather second face per among form
often important things looked early white case john become large big need four within felt along children
saw best church ever least power development light thing seemed family interest want members mind country
area others done turned although open god service problem certain kind different thus began door help means
sense whole matter perhaps itself york times law human line above name example action company hands local
show whether five history gave today either act feet across taken past quite anything seen having death
week experience body word half really field am car words already themselves information tell together
college shall money period held keep sure free real probably seems political cannot behind miss question air`)

func words(r *rand.Rand, n int) string {
	var b strings.Builder
	b.Grow(n * 6)
	for i := range n {
		if i > 0 {
			b.WriteByte(' ')
		}
		b.WriteString(vocab[r.IntN(len(vocab))])
	}
	return b.String()
}

// lenIn draws a length uniformly from [max(floor(n·ratio), 1), n], as bench_serving's random
// dataset does.
func lenIn(r *rand.Rand, n int, ratio float64) int {
	lo := max(int(float64(n)*ratio), 1)
	if n <= lo {
		return max(n, 1)
	}
	return lo + r.IntN(n-lo+1)
}

// RandomPrompts is the "random" dataset: n prompts with input and output lengths drawn from
// [len·ratio, len].
func RandomPrompts(r *rand.Rand, n, inputLen, outputLen int, ratio float64) []Prompt {
	ps := make([]Prompt, n)
	for i := range ps {
		in := lenIn(r, inputLen, ratio)
		ps[i] = Prompt{Text: words(r, in), InputLen: in, OutputLen: lenIn(r, outputLen, ratio)}
	}
	return ps
}

// SharedPrefixPrompts is the "generated-shared-prefix" dataset: groups × perGroup prompts, each a
// group's system prompt, a blank line and its own question, shuffled so that groups interleave.
func SharedPrefixPrompts(r *rand.Rand, groups, perGroup, systemLen, questionLen, outputLen int) []Prompt {
	ps := make([]Prompt, 0, groups*perGroup)
	for range groups {
		system := words(r, systemLen)
		for range perGroup {
			ps = append(ps, Prompt{
				Text:      system + "\n\n" + words(r, questionLen),
				InputLen:  systemLen + questionLen,
				OutputLen: outputLen,
			})
		}
	}
	r.Shuffle(len(ps), func(i, j int) { ps[i], ps[j] = ps[j], ps[i] })
	return ps
}

// shareGPTTurn accepts both ShareGPT spellings: {"from","value"} and {"role","content"}.
type shareGPTTurn struct {
	Value   string `json:"value"`
	Content string `json:"content"`
}

func (t shareGPTTurn) text() string {
	if t.Value != "" {
		return t.Value
	}
	return t.Content
}

type shareGPTEntry struct {
	Conversations []shareGPTTurn `json:"conversations"`
	Conversation  []shareGPTTurn `json:"conversation"`
	Messages      []shareGPTTurn `json:"messages"`
}

// ReadShareGPT reads a ShareGPT-format JSON array and returns up to n prompts the way
// bench_serving samples them: the first turn of each conversation with at least two turns is the
// prompt, the second turn's length is the output length unless fixedOutput > 0, entries are
// shuffled, pairs shorter than 2 tokens are dropped, and without fixedOutput so are prompts over 1024
// tokens or pairs over 2048. The file is decoded entry by entry so large dumps stay cheap.
func ReadShareGPT(r *rand.Rand, src io.Reader, n, fixedOutput int) ([]Prompt, error) {
	dec := json.NewDecoder(bufio.NewReaderSize(src, 1<<20))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('[') {
		return nil, fmt.Errorf("sharegpt: want a JSON array of conversations: %v", err)
	}
	var all []Prompt
	for dec.More() {
		var e shareGPTEntry
		if err := dec.Decode(&e); err != nil {
			return nil, fmt.Errorf("sharegpt: entry %d: %w", len(all), err)
		}
		turns := e.Conversations
		if turns == nil {
			turns = e.Conversation
		}
		if turns == nil {
			turns = e.Messages
		}
		if len(turns) < 2 {
			continue
		}
		prompt := turns[0].text()
		all = append(all, Prompt{Text: prompt, InputLen: len(strings.Fields(prompt)),
			OutputLen: len(strings.Fields(turns[1].text()))})
	}
	r.Shuffle(len(all), func(i, j int) { all[i], all[j] = all[j], all[i] })
	ps := make([]Prompt, 0, min(n, len(all)))
	for _, p := range all {
		if len(ps) == n {
			break
		}
		if fixedOutput > 0 {
			p.OutputLen = fixedOutput
		}
		if p.InputLen < 2 || p.OutputLen < 2 {
			continue
		}
		if fixedOutput == 0 && (p.InputLen > 1024 || p.InputLen+p.OutputLen > 2048) {
			continue
		}
		ps = append(ps, p)
	}
	if len(ps) == 0 {
		return nil, errors.New("sharegpt: no usable conversations")
	}
	return ps, nil
}

// traceLine accepts both our field names and Mooncake's (input_length, output_length).
type traceLine struct {
	Timestamp    *float64 `json:"timestamp"`
	InputLen     int      `json:"input_len"`
	InputLength  int      `json:"input_length"`
	OutputLen    int      `json:"output_len"`
	OutputLength int      `json:"output_length"`
}

// ReadTrace reads a JSONL trace, one request per line with a timestamp in milliseconds (Mooncake's
// unit) and input/output lengths, and returns up to n prompts whose At is the timestamp relative to
// the first line divided by speedup. Lines must be in time order.
func ReadTrace(r *rand.Rand, src io.Reader, n int, speedup float64) ([]Prompt, error) {
	if speedup <= 0 {
		return nil, fmt.Errorf("trace: speedup must be > 0, got %v", speedup)
	}
	sc := bufio.NewScanner(src)
	sc.Buffer(make([]byte, 64<<10), 16<<20)
	var ps []Prompt
	var first, last float64
	for line := 1; sc.Scan() && len(ps) < n; line++ {
		b := sc.Bytes()
		if len(strings.TrimSpace(string(b))) == 0 {
			continue
		}
		var t traceLine
		if err := json.Unmarshal(b, &t); err != nil {
			return nil, fmt.Errorf("trace line %d: %w", line, err)
		}
		in, out := max(t.InputLen, t.InputLength), max(t.OutputLen, t.OutputLength)
		if t.Timestamp == nil || in <= 0 || out <= 0 {
			return nil, fmt.Errorf("trace line %d: want timestamp, input_len > 0 and output_len > 0", line)
		}
		ts := *t.Timestamp
		if len(ps) == 0 {
			first = ts
		} else if ts < last {
			return nil, fmt.Errorf("trace line %d: timestamp %v before the previous %v", line, ts, last)
		}
		last = ts
		at := time.Duration((ts - first) / speedup * float64(time.Millisecond))
		ps = append(ps, Prompt{Text: words(r, in), InputLen: in, OutputLen: out, At: at})
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("trace: %w", err)
	}
	if len(ps) == 0 {
		return nil, errors.New("trace: no requests")
	}
	return ps, nil
}

// DatasetConfig selects a dataset and holds the flags of every kind.
type DatasetConfig struct {
	Name       string // random, generated-shared-prefix, sharegpt or trace
	Path       string // the ShareGPT JSON or the trace JSONL
	NumPrompts int    // ignored by generated-shared-prefix, which makes groups × prompts per group

	RandomInputLen, RandomOutputLen int
	RandomRangeRatio                float64

	GSPNumGroups, GSPPromptsPerGroup, GSPSystemPromptLen, GSPQuestionLen, GSPOutputLen int

	ShareGPTOutputLen int     // fixed output length; 0 uses each conversation's reply length
	TraceSpeedup      float64 // trace timestamps are divided by this
}

// Load builds the prompts.
func (c DatasetConfig) Load(r *rand.Rand) ([]Prompt, error) {
	switch c.Name {
	case "random":
		return RandomPrompts(r, c.NumPrompts, c.RandomInputLen, c.RandomOutputLen, c.RandomRangeRatio), nil
	case "generated-shared-prefix":
		return SharedPrefixPrompts(r, c.GSPNumGroups, c.GSPPromptsPerGroup, c.GSPSystemPromptLen,
			c.GSPQuestionLen, c.GSPOutputLen), nil
	case "sharegpt", "trace":
		if c.Path == "" {
			return nil, fmt.Errorf("dataset %s needs --dataset-path", c.Name)
		}
		f, err := os.Open(c.Path)
		if err != nil {
			return nil, err
		}
		defer f.Close()
		if c.Name == "sharegpt" {
			return ReadShareGPT(r, f, c.NumPrompts, c.ShareGPTOutputLen)
		}
		return ReadTrace(r, f, c.NumPrompts, c.TraceSpeedup)
	}
	return nil, fmt.Errorf("unknown dataset %q (want random, generated-shared-prefix, sharegpt or trace)", c.Name)
}

// Args are the dataset's settings under bench_serving's report keys.
func (c DatasetConfig) Args() map[string]any {
	switch c.Name {
	case "random":
		return map[string]any{"random_input_len": c.RandomInputLen, "random_output_len": c.RandomOutputLen,
			"random_range_ratio": c.RandomRangeRatio}
	case "generated-shared-prefix":
		return map[string]any{"gsp_num_groups": c.GSPNumGroups, "gsp_prompts_per_group": c.GSPPromptsPerGroup,
			"gsp_system_prompt_len": c.GSPSystemPromptLen, "gsp_question_len": c.GSPQuestionLen,
			"gsp_output_len": c.GSPOutputLen}
	case "sharegpt":
		return map[string]any{"dataset_path": c.Path, "sharegpt_output_len": c.ShareGPTOutputLen}
	}
	return map[string]any{"dataset_path": c.Path, "trace_speedup": c.TraceSpeedup}
}
