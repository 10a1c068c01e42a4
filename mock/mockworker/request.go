package mockworker

import (
	"bytes"
	"encoding/json"
	"net/http"
	"strconv"
	"strings"
)

// endpoint is a POST route that does model work ("generation request" in the
// knobs' and the introspection's sense).
type endpoint uint8

const (
	epGenerate endpoint = iota
	epChat
	epCompletions
	epEmbeddings
	epClassify
	epRerank
	epResponses
)

// generates reports whether the endpoint emits tokens and, in PD roles,
// needs the bootstrap fields (as SGLang's PD servers do).
func (e endpoint) generates() bool { return e <= epCompletions }

// maxChoices bounds n so a request cannot make the mock allocate without limit.
const maxChoices = 128

// rawBody is every request field the mock understands, across endpoints.
// Fields whose JSON type varies are kept raw and decoded by hand.
type rawBody struct {
	Text           json.RawMessage `json:"text"`
	InputIDs       json.RawMessage `json:"input_ids"`
	SamplingParams json.RawMessage `json:"sampling_params"`
	ReturnLogprob  json.RawMessage `json:"return_logprob"`

	Model               string          `json:"model"`
	Messages            []chatMessage   `json:"messages"`
	Prompt              json.RawMessage `json:"prompt"`
	Input               json.RawMessage `json:"input"`
	Query               string          `json:"query"`
	Documents           []string        `json:"documents"`
	MaxTokens           *int            `json:"max_tokens"`
	MaxCompletionTokens *int            `json:"max_completion_tokens"`
	MaxOutputTokens     *int            `json:"max_output_tokens"`
	N                   *int            `json:"n"`
	Logprobs            json.RawMessage `json:"logprobs"`
	TopLogprobs         *int            `json:"top_logprobs"`
	Stream              bool            `json:"stream"`
	StreamOptions       *struct {
		IncludeUsage bool `json:"include_usage"`
	} `json:"stream_options"`

	BootstrapHost json.RawMessage `json:"bootstrap_host"`
	BootstrapPort json.RawMessage `json:"bootstrap_port"`
	BootstrapRoom json.RawMessage `json:"bootstrap_room"`

	RoutedDPRank        json.RawMessage `json:"routed_dp_rank"`
	DataParallelRank    json.RawMessage `json:"data_parallel_rank"`
	DisaggPrefillDPRank json.RawMessage `json:"disagg_prefill_dp_rank"`

	KVTransferParams json.RawMessage `json:"kv_transfer_params"` // the vLLM roles'
}

type chatMessage struct {
	Role    string          `json:"role"`
	Content json.RawMessage `json:"content"`
}

type samplingParams struct {
	MaxNewTokens *int `json:"max_new_tokens"`
}

// prompt is one input sequence: its bytes (text, or input_ids as JSON text)
// and its mock token ids.
type prompt struct {
	text []byte
	ids  []int
}

// genItem is one sequence to answer: a batch element or a choice.
type genItem struct {
	prompt
	limit       int  // requested max tokens, -1 if none
	firstChoice bool // first item of its prompt (for prompt token counts)
	logprob     bool // /generate return_logprob
	entry       int  // index into request.boot
	choice      int  // OpenAI choice index
}

// bootEntry is one element of the bootstrap fields.
type bootEntry struct {
	host     string
	port     int
	portNull bool
	room     uint64
}

type request struct {
	ep           endpoint
	items        []genItem
	batch        bool // /generate with a list input: the answer is a JSON array
	stream       bool
	includeUsage bool
	model        string
	logprobs     bool // OpenAI logprobs requested
	topLogprobs  int
	boot         []bootEntry // nil when the request carries no bootstrap fields
	bootArray    bool        // bootstrap fields came as arrays
	query        string      // rerank
	documents    []string    // rerank
	ranks        dpRanks
	// raw bootstrap and rank values, for introspection
	bootHost, bootPort, bootRoom            json.RawMessage
	routedRank, legacyRank, prefillRankJSON json.RawMessage
	kvParams                                json.RawMessage // vLLM's kv_transfer_params
}

func badRequest(format string, args ...any) *apiError {
	return errorf(http.StatusBadRequest, format, args...)
}

// parseRequest validates a request body for ep on an engine of dpSize
// ranks. It never panics on any input.
func parseRequest(ep endpoint, body []byte, dpSize int) (*request, *apiError) {
	var raw rawBody
	if err := json.Unmarshal(body, &raw); err != nil {
		return nil, badRequest("invalid request body: %v", err)
	}
	r := &request{ep: ep, stream: raw.Stream, model: raw.Model,
		bootHost: raw.BootstrapHost, bootPort: raw.BootstrapPort, bootRoom: raw.BootstrapRoom,
		routedRank: raw.RoutedDPRank, legacyRank: raw.DataParallelRank, prefillRankJSON: raw.DisaggPrefillDPRank,
		kvParams: raw.KVTransferParams}
	var err *apiError
	if r.ranks, err = parseRanks(&raw, dpSize); err != nil {
		return nil, err
	}
	if raw.StreamOptions != nil {
		r.includeUsage = raw.StreamOptions.IncludeUsage
	}
	var bootN int // expected length of bootstrap arrays
	switch ep {
	case epGenerate:
		bootN, err = r.parseGenerate(&raw)
	case epChat:
		bootN, err = r.parseChat(&raw)
	case epCompletions:
		bootN, err = r.parseCompletions(&raw)
	case epEmbeddings, epClassify:
		err = r.parseInputs(raw.Input, "input")
	case epRerank:
		err = r.parseRerank(&raw)
	case epResponses:
		err = r.parseResponses(&raw)
	}
	if err != nil {
		return nil, err
	}
	if ep.generates() {
		if r.boot, r.bootArray, err = parseBootstrap(&raw, bootN); err != nil {
			return nil, err
		}
	}
	return r, nil
}

func (r *request) parseGenerate(raw *rawBody) (int, *apiError) {
	var prompts []prompt
	switch {
	case isNull(raw.Text) == isNull(raw.InputIDs):
		return 0, badRequest("exactly one of text or input_ids must be given")
	case !isNull(raw.Text):
		if peek(raw.Text) == '[' {
			var texts []string
			if err := json.Unmarshal(raw.Text, &texts); err != nil {
				return 0, badRequest("text: %v", err)
			}
			r.batch = true
			for _, t := range texts {
				prompts = append(prompts, textPrompt(t))
			}
		} else {
			var t string
			if err := json.Unmarshal(raw.Text, &t); err != nil {
				return 0, badRequest("text: %v", err)
			}
			prompts = []prompt{textPrompt(t)}
		}
	default:
		var err *apiError
		if prompts, r.batch, err = idsPrompts(raw.InputIDs, "input_ids"); err != nil {
			return 0, err
		}
	}
	if len(prompts) == 0 {
		return 0, badRequest("empty batch")
	}
	n := len(prompts)
	limits, err := samplingLimits(raw.SamplingParams, n)
	if err != nil {
		return 0, err
	}
	logprobs, err := boolList(raw.ReturnLogprob, "return_logprob", n)
	if err != nil {
		return 0, err
	}
	r.items = make([]genItem, n)
	for i, p := range prompts {
		r.items[i] = genItem{prompt: p, limit: limits[i], logprob: logprobs[i], entry: i, firstChoice: true}
	}
	return n, nil
}

func (r *request) parseChat(raw *rawBody) (int, *apiError) {
	if len(raw.Messages) == 0 {
		return 0, badRequest("messages must be a non-empty list")
	}
	parts := make([]string, 0, len(raw.Messages))
	for i, m := range raw.Messages {
		t, err := contentText(m.Content)
		if err != nil {
			return 0, badRequest("messages[%d].content: %s", i, err.message)
		}
		parts = append(parts, t)
	}
	n, err := parseN(raw)
	if err != nil {
		return 0, err
	}
	if err := r.parseChatLogprobs(raw); err != nil {
		return 0, err
	}
	limit, err := minLimit(raw.MaxTokens, raw.MaxCompletionTokens)
	if err != nil {
		return 0, err
	}
	p := textPrompt(strings.Join(parts, "\n"))
	r.items = make([]genItem, n)
	for j := range r.items {
		r.items[j] = genItem{prompt: p, limit: limit, entry: j, choice: j, firstChoice: j == 0}
	}
	return n, nil
}

func (r *request) parseChatLogprobs(raw *rawBody) *apiError {
	if !isNull(raw.Logprobs) {
		if err := json.Unmarshal(raw.Logprobs, &r.logprobs); err != nil {
			return badRequest("logprobs: %v", err)
		}
	}
	if raw.TopLogprobs != nil {
		if *raw.TopLogprobs < 0 || *raw.TopLogprobs > 20 {
			return badRequest("top_logprobs must be in [0, 20]")
		}
		r.topLogprobs = *raw.TopLogprobs
	}
	return nil
}

func (r *request) parseCompletions(raw *rawBody) (int, *apiError) {
	prompts, _, err := promptList(raw.Prompt, "prompt")
	if err != nil {
		return 0, err
	}
	n, err := parseN(raw)
	if err != nil {
		return 0, err
	}
	if !isNull(raw.Logprobs) {
		var k int
		if err := json.Unmarshal(raw.Logprobs, &k); err != nil || k < 0 || k > 20 {
			return 0, badRequest("logprobs must be an integer in [0, 20]")
		}
		r.logprobs, r.topLogprobs = true, k
	}
	limit, err := minLimit(raw.MaxTokens, nil)
	if err != nil {
		return 0, err
	}
	if len(prompts)*n > maxChoices {
		return 0, badRequest("too many choices: %d prompts x n=%d", len(prompts), n)
	}
	r.items = make([]genItem, 0, len(prompts)*n)
	for p, pr := range prompts {
		for j := range n {
			r.items = append(r.items, genItem{prompt: pr, limit: limit, entry: p, choice: p*n + j, firstChoice: j == 0})
		}
	}
	return len(prompts), nil
}

// parseN validates the OpenAI n (choices per prompt).
func parseN(raw *rawBody) (int, *apiError) {
	n := 1
	if raw.N != nil {
		n = *raw.N
	}
	if n < 1 || n > maxChoices {
		return 0, badRequest("n must be in [1, %d]", maxChoices)
	}
	return n, nil
}

func (r *request) parseInputs(rawInput json.RawMessage, field string) *apiError {
	prompts, _, err := promptList(rawInput, field)
	if err != nil {
		return err
	}
	for i, p := range prompts {
		r.items = append(r.items, genItem{prompt: p, limit: -1, choice: i, firstChoice: true})
	}
	return nil
}

func (r *request) parseRerank(raw *rawBody) *apiError {
	if raw.Query == "" || len(raw.Documents) == 0 {
		return badRequest("query and a non-empty documents list are required")
	}
	r.query, r.documents = raw.Query, raw.Documents
	for i, d := range raw.Documents {
		r.items = append(r.items, genItem{prompt: textPrompt(raw.Query + "\n" + d), limit: -1, choice: i, firstChoice: true})
	}
	return nil
}

func (r *request) parseResponses(raw *rawBody) *apiError {
	var text string
	switch peek(raw.Input) {
	case '"':
		if err := json.Unmarshal(raw.Input, &text); err != nil {
			return badRequest("input: %v", err)
		}
	case '[':
		var msgs []chatMessage
		if err := json.Unmarshal(raw.Input, &msgs); err != nil {
			return badRequest("input: %v", err)
		}
		parts := make([]string, 0, len(msgs))
		for i, m := range msgs {
			t, err := contentText(m.Content)
			if err != nil {
				return badRequest("input[%d].content: %s", i, err.message)
			}
			parts = append(parts, t)
		}
		text = strings.Join(parts, "\n")
	default:
		return badRequest("input must be a string or a list of messages")
	}
	limit, err := minLimit(raw.MaxOutputTokens, nil)
	if err != nil {
		return err
	}
	r.items = []genItem{{prompt: textPrompt(text), limit: limit, firstChoice: true}}
	return nil
}

// parseBootstrap reads the bootstrap fields. Absent (or null host/room)
// gives nil. Scalars apply to every item; arrays must have length n.
func parseBootstrap(raw *rawBody, n int) ([]bootEntry, bool, *apiError) {
	if isNull(raw.BootstrapHost) || isNull(raw.BootstrapRoom) {
		return nil, false, nil
	}
	hosts, hostArr, err := scalarOrList[string](raw.BootstrapHost, "bootstrap_host")
	if err != nil {
		return nil, false, err
	}
	rooms, roomArr, err := scalarOrList[uint64](raw.BootstrapRoom, "bootstrap_room")
	if err != nil {
		return nil, false, err
	}
	ports := []*int{nil}
	portArr := false
	if !isNull(raw.BootstrapPort) {
		if ports, portArr, err = scalarOrList[*int](raw.BootstrapPort, "bootstrap_port"); err != nil {
			return nil, false, err
		}
	}
	count := 1
	for _, f := range []struct {
		name string
		arr  bool
		l    int
	}{{"bootstrap_host", hostArr, len(hosts)}, {"bootstrap_port", portArr, len(ports)}, {"bootstrap_room", roomArr, len(rooms)}} {
		if !f.arr {
			continue
		}
		if f.l != n {
			return nil, false, badRequest("%s has %d elements, want %d (the batch size)", f.name, f.l, n)
		}
		count = n
	}
	at := func(i, l int) int { return min(i, l-1) } // scalars broadcast
	entries := make([]bootEntry, count)
	for i := range entries {
		e := bootEntry{host: hosts[at(i, len(hosts))], room: rooms[at(i, len(rooms))]}
		if p := ports[at(i, len(ports))]; p == nil {
			e.portNull = true
		} else if *p < 0 || *p > 65535 {
			return nil, false, badRequest("bootstrap_port %d out of range", *p)
		} else {
			e.port = *p
		}
		entries[i] = e
	}
	return entries, count > 1 || hostArr || portArr || roomArr, nil
}

// scalarOrList decodes a JSON value of type T or a non-empty list of T.
func scalarOrList[T any](raw json.RawMessage, field string) ([]T, bool, *apiError) {
	if peek(raw) == '[' {
		var l []T
		if err := json.Unmarshal(raw, &l); err != nil {
			return nil, false, badRequest("%s: %v", field, err)
		}
		if len(l) == 0 {
			return nil, false, badRequest("%s: empty list", field)
		}
		return l, true, nil
	}
	var v T
	if err := json.Unmarshal(raw, &v); err != nil {
		return nil, false, badRequest("%s: %v", field, err)
	}
	return []T{v}, false, nil
}

// promptList decodes string | [string] | [int] | [[int]] (OpenAI prompt/input).
func promptList(raw json.RawMessage, field string) ([]prompt, bool, *apiError) {
	switch peek(raw) {
	case '"':
		var t string
		if err := json.Unmarshal(raw, &t); err != nil {
			return nil, false, badRequest("%s: %v", field, err)
		}
		return []prompt{textPrompt(t)}, false, nil
	case '[':
		var elems []json.RawMessage
		if err := json.Unmarshal(raw, &elems); err != nil {
			return nil, false, badRequest("%s: %v", field, err)
		}
		if len(elems) == 0 {
			return nil, false, badRequest("%s: empty list", field)
		}
		if peek(elems[0]) != '"' {
			return idsPrompts(raw, field)
		}
		var texts []string
		if err := json.Unmarshal(raw, &texts); err != nil {
			return nil, false, badRequest("%s: %v", field, err)
		}
		ps := make([]prompt, len(texts))
		for i, t := range texts {
			ps[i] = textPrompt(t)
		}
		return ps, true, nil
	}
	return nil, false, badRequest("%s must be a string, a list of strings or token ids", field)
}

// idsPrompts decodes [int] (one prompt) or [[int]] (a batch).
func idsPrompts(raw json.RawMessage, field string) ([]prompt, bool, *apiError) {
	var elems []json.RawMessage
	if err := json.Unmarshal(raw, &elems); err != nil {
		return nil, false, badRequest("%s: %v", field, err)
	}
	if len(elems) == 0 {
		return nil, false, badRequest("%s: empty list", field)
	}
	if peek(elems[0]) == '[' {
		var batch [][]int
		if err := json.Unmarshal(raw, &batch); err != nil {
			return nil, false, badRequest("%s: %v", field, err)
		}
		ps := make([]prompt, len(batch))
		for i, ids := range batch {
			ps[i] = idsPrompt(ids)
		}
		return ps, true, nil
	}
	var ids []int
	if err := json.Unmarshal(raw, &ids); err != nil {
		return nil, false, badRequest("%s: %v", field, err)
	}
	return []prompt{idsPrompt(ids)}, false, nil
}

func textPrompt(t string) prompt { return prompt{text: []byte(t), ids: wordIDs(t)} }

func idsPrompt(ids []int) prompt {
	b := make([]byte, 0, 1+len(ids)*6)
	b = append(b, '[')
	for i, id := range ids {
		if i > 0 {
			b = append(b, ',')
		}
		b = strconv.AppendInt(b, int64(id), 10)
	}
	return prompt{text: append(b, ']'), ids: ids}
}

// contentText flattens a chat content: a string, null, or a list of parts
// whose text parts are joined.
func contentText(raw json.RawMessage) (string, *apiError) {
	if isNull(raw) {
		return "", nil
	}
	switch peek(raw) {
	case '"':
		var s string
		if err := json.Unmarshal(raw, &s); err != nil {
			return "", badRequest("%v", err)
		}
		return s, nil
	case '[':
		var parts []struct {
			Type string `json:"type"`
			Text string `json:"text"`
		}
		if err := json.Unmarshal(raw, &parts); err != nil {
			return "", badRequest("%v", err)
		}
		texts := make([]string, 0, len(parts))
		for _, p := range parts {
			if p.Text != "" {
				texts = append(texts, p.Text)
			}
		}
		return strings.Join(texts, " "), nil
	}
	return "", badRequest("content must be a string, null or a list of parts")
}

// samplingLimits reads max_new_tokens from a sampling_params object, or a
// list of n objects; -1 where absent.
func samplingLimits(raw json.RawMessage, n int) ([]int, *apiError) {
	limits := make([]int, n)
	for i := range limits {
		limits[i] = -1
	}
	if isNull(raw) {
		return limits, nil
	}
	sps, arr, err := scalarOrList[samplingParams](raw, "sampling_params")
	if err != nil {
		return nil, err
	}
	if arr && len(sps) != n {
		return nil, badRequest("sampling_params has %d elements, want %d", len(sps), n)
	}
	for i := range limits {
		l, err := minLimit(sps[min(i, len(sps)-1)].MaxNewTokens, nil)
		if err != nil {
			return nil, err
		}
		limits[i] = l
	}
	return limits, nil
}

// boolList reads a bool or a list of n bools; false where absent.
func boolList(raw json.RawMessage, field string, n int) ([]bool, *apiError) {
	out := make([]bool, n)
	if isNull(raw) {
		return out, nil
	}
	vals, arr, err := scalarOrList[bool](raw, field)
	if err != nil {
		return nil, err
	}
	if arr && len(vals) != n {
		return nil, badRequest("%s has %d elements, want %d", field, len(vals), n)
	}
	for i := range out {
		out[i] = vals[min(i, len(vals)-1)]
	}
	return out, nil
}

// minLimit returns the smaller of the given token limits, -1 if none is set.
func minLimit(a, b *int) (int, *apiError) {
	limit := -1
	for _, p := range []*int{a, b} {
		if p == nil {
			continue
		}
		if *p < 0 {
			return 0, badRequest("max tokens must not be negative")
		}
		if limit < 0 || *p < limit {
			limit = *p
		}
	}
	return limit, nil
}

// peek returns the first non-space byte of a JSON value, 0 if empty.
func peek(raw []byte) byte {
	raw = bytes.TrimLeft(raw, " \t\r\n")
	if len(raw) == 0 {
		return 0
	}
	return raw[0]
}

func isNull(raw json.RawMessage) bool {
	return len(raw) == 0 || string(bytes.TrimSpace(raw)) == "null"
}
