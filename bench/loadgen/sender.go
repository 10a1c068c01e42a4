package loadgen

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"
)

// Request is a prompt with its body already rendered, so the send loop does no JSON work.
type Request struct {
	Prompt
	Body []byte
}

// BuildRequests renders every prompt's body once, before the clock starts.
func BuildRequests(b Backend, ps []Prompt, o BodyOptions) ([]Request, error) {
	rs := make([]Request, len(ps))
	for i, p := range ps {
		body, err := b.Body(p, o)
		if err != nil {
			return nil, err
		}
		rs[i] = Request{Prompt: p, Body: body}
	}
	return rs, nil
}

// Error kinds. HTTP failures are "http_<status>".
const (
	ErrTimeout   = "timeout"   // the per-request timeout expired (or a socket timeout)
	ErrTransport = "transport" // connect, reset, truncated body
	ErrStream    = "stream"    // an SSE error event, malformed chunk, or a reply with no content
	errCancelled = "cancelled" // the run was stopped; not a server error, never reported
)

// Result is one request's measurement. Times are on the sender's clock.
type Result struct {
	InputLen  int
	OutputLen int
	Start     time.Time
	TTFT      time.Duration
	Latency   time.Duration
	ITL       []time.Duration
	Err       string // "" on success, else an error kind
	Msg       string // the error's text
}

// SenderConfig configures a Sender.
type SenderConfig struct {
	BaseURL  string
	Backend  Backend
	APIKey   string           // sent as "Authorization: Bearer"
	Timeout  time.Duration    // per request, 0 for none
	MaxConns int              // idle keep-alive connections to keep; size it to the concurrency
	Now      func() time.Time // the clock; time.Now when nil (tests inject a scripted one)
}

// Sender posts requests and times their replies.
type Sender struct {
	client  *http.Client
	url     string
	auth    string
	timeout time.Duration
	now     func() time.Time
	sglang  bool
}

// NewSender builds a Sender with its own keep-alive connection pool.
func NewSender(c SenderConfig) *Sender {
	now := c.Now
	if now == nil {
		now = time.Now
	}
	conns := max(c.MaxConns, 64)
	tr := &http.Transport{
		DialContext:         (&net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		MaxIdleConns:        conns,
		MaxIdleConnsPerHost: conns,
		IdleConnTimeout:     90 * time.Second,
		// Compression would batch stream chunks and distort TTFT and ITL.
		DisableCompression: true,
	}
	s := &Sender{
		client:  &http.Client{Transport: tr},
		url:     strings.TrimRight(c.BaseURL, "/") + c.Backend.Path(),
		timeout: c.Timeout,
		now:     now,
		sglang:  c.Backend == SGLang,
	}
	if c.APIKey != "" {
		s.auth = "Bearer " + c.APIKey
	}
	return s
}

// Close drops the idle connections.
func (s *Sender) Close() { s.client.CloseIdleConnections() }

// readers are pooled: a run may hold a thousand streams open, and each needs one.
var readers = sync.Pool{New: func() any { return bufio.NewReaderSize(nil, 16<<10) }}

// Send posts one request and measures it the way bench_serving does: TTFT when the first chunk
// with generated text arrives, an ITL sample per later content chunk (for /generate, a chunk
// carrying k new tokens gives k samples of gap/k), E2E when the body ends. The clock is read once
// at the start, once per content chunk and once at the end.
func (s *Sender) Send(ctx context.Context, r *Request) Result {
	res := Result{InputLen: r.InputLen}
	rctx := ctx
	if s.timeout > 0 {
		var cancel context.CancelFunc
		rctx, cancel = context.WithTimeout(ctx, s.timeout)
		defer cancel()
	}
	req, err := http.NewRequestWithContext(rctx, http.MethodPost, s.url, bytes.NewReader(r.Body))
	if err != nil {
		res.Err, res.Msg = ErrTransport, err.Error()
		return res
	}
	req.Header.Set("Content-Type", "application/json")
	if s.auth != "" {
		req.Header.Set("Authorization", s.auth)
	}
	res.Start = s.now()
	resp, err := s.client.Do(req)
	if err != nil {
		res.Err, res.Msg = classify(ctx, err), err.Error()
		return res
	}
	defer resp.Body.Close()
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		res.Err, res.Msg = fmt.Sprintf("http_%d", resp.StatusCode), strings.TrimSpace(string(msg))
		return res
	}
	st := stream{s: s, res: &res, tokens: -1, limit: max(r.OutputLen, 1<<12)}
	res.ITL = make([]time.Duration, 0, r.OutputLen)
	if strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		err = st.readSSE(resp.Body)
	} else {
		err = st.readWhole(resp.Body)
	}
	end := s.now()
	switch {
	case err != nil && res.Err == "":
		res.Err, res.Msg = classify(ctx, err), err.Error()
	case res.Err != "":
	case st.chunks == 0:
		res.Err, res.Msg = ErrStream, "reply carried no generated text"
	default:
		res.Latency = end.Sub(res.Start)
		res.OutputLen = st.chunks
		if st.tokens >= 0 {
			res.OutputLen = st.tokens
		}
	}
	if res.Err != "" {
		res.ITL = nil
	}
	return res
}

// classify names a transport-level failure. A cancelled run is not the server's fault.
func classify(ctx context.Context, err error) string {
	if ctx.Err() != nil {
		return errCancelled
	}
	var ne net.Error
	if errors.Is(err, context.DeadlineExceeded) || (errors.As(err, &ne) && ne.Timeout()) {
		return ErrTimeout
	}
	if errors.Is(err, errBadJSON) {
		return ErrStream
	}
	return ErrTransport
}

// stream accumulates one reply's chunks into its Result.
type stream struct {
	s          *Sender
	res        *Result
	last       time.Time
	chunks     int // content chunks seen
	tokens     int // last completion_tokens the server reported, -1 if never
	lastTokens int
	limit      int // ITL samples to keep at most: the output tokens asked for
}

// readSSE reads "data: ..." lines until EOF. Other SSE fields and comments are ignored, and so is
// anything after [DONE]; the body is still read to its end so the connection can be reused.
func (st *stream) readSSE(body io.Reader) error {
	br := readers.Get().(*bufio.Reader)
	br.Reset(body)
	defer func() { br.Reset(nil); readers.Put(br) }()
	var long []byte // a line longer than the reader's buffer
	done := false
	for {
		line, err := br.ReadSlice('\n')
		if err == bufio.ErrBufferFull {
			long = append(long, line...)
			continue
		}
		if len(long) > 0 {
			line = append(long, line...)
			long = long[:0]
		}
		if err != nil && err != io.EOF {
			return err
		}
		if data, ok := sseData(line); ok && !done {
			if string(data) == "[DONE]" {
				done = true
			} else if perr := st.chunk(data); perr != nil {
				return perr
			}
		}
		if err == io.EOF {
			return nil
		}
	}
}

// sseData returns the payload of a "data:" line.
func sseData(line []byte) ([]byte, bool) {
	line = bytes.TrimRight(line, "\r\n")
	rest, ok := bytes.CutPrefix(line, []byte("data:"))
	if !ok {
		return nil, false
	}
	return bytes.TrimLeft(rest, " "), true
}

// readWhole handles a non-streamed reply: one JSON document, so TTFT equals E2E.
func (st *stream) readWhole(body io.Reader) error {
	b, err := io.ReadAll(body)
	if err != nil {
		return err
	}
	return st.chunk(b)
}

// chunk applies one JSON chunk. A chunk counts as content when it carries text; for /generate,
// whose text is cumulative, when completion_tokens grew (bench_serving skips chunks that add none).
func (st *stream) chunk(data []byte) error {
	c, err := parseChunk(data)
	if err != nil {
		return err
	}
	if c.err {
		st.res.Err, st.res.Msg = ErrStream, string(data[:min(len(data), 512)])
		return nil
	}
	newTokens := 1
	if c.tokens >= 0 {
		st.tokens = c.tokens
		if st.s.sglang {
			newTokens = c.tokens - st.lastTokens
			st.lastTokens = c.tokens
			c.content = c.content && newTokens > 0
		}
	}
	if !c.content {
		return nil
	}
	t := st.s.now()
	if st.chunks == 0 {
		st.res.TTFT = t.Sub(st.res.Start)
	} else {
		gap := t.Sub(st.last)
		// A server cannot produce more tokens than asked for; the bound keeps a bogus count from
		// making us allocate without limit.
		newTokens = min(newTokens, max(st.limit-len(st.res.ITL), 1))
		if !st.s.sglang || newTokens < 1 {
			newTokens = 1
		}
		for range newTokens {
			st.res.ITL = append(st.res.ITL, gap/time.Duration(newTokens))
		}
	}
	st.last = t
	st.chunks++
	return nil
}

// DiscoverModel asks GET /v1/models for the served model, as bench_serving does without --model.
func DiscoverModel(ctx context.Context, baseURL, apiKey string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, strings.TrimRight(baseURL, "/")+"/v1/models", nil)
	if err != nil {
		return "", err
	}
	if apiKey != "" {
		req.Header.Set("Authorization", "Bearer "+apiKey)
	}
	req.Close = true // a one-off: leave no idle connection behind
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return "", fmt.Errorf("model discovery: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("model discovery: GET /v1/models: %s", resp.Status)
	}
	var list struct {
		Data []struct {
			ID string `json:"id"`
		} `json:"data"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&list); err != nil {
		return "", fmt.Errorf("model discovery: %w", err)
	}
	if len(list.Data) == 0 || list.Data[0].ID == "" {
		return "", errors.New("model discovery: /v1/models lists no model")
	}
	return list.Data[0].ID, nil
}
