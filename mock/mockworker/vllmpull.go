package mockworker

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// The decode's side of the KV side channel: POST /_mock/vllm/pull to the
// prefill over connections kept open between pulls, as vLLM's side
// channels are. A pull is one write and one read on the handler's own
// goroutine: net/http's client kept two more goroutines per connection
// and handed every pull between them, which made the mocks, not the
// routers, the dearer part of a bench request (make bench-vllm).

// pullConn is one side-channel connection.
type pullConn struct {
	net.Conn
	br *bufio.Reader
}

const (
	pullTimeout   = 10 * time.Second
	maxPullReply  = 1 << 20
	maxIdlePulls  = 256 // kept connections per prefill
	pullPath      = "/_mock/vllm/pull"
	pullUserAgent = "mockworker-vllm-decode"
)

// errPullReplyTooLarge is a side channel answering more than maxPullReply.
var errPullReplyTooLarge = errors.New("pull reply longer than 1 MiB")

func (s *Server) pullKV(ctx context.Context, xid string, p *decodeParams, digest string) *apiError {
	addr := net.JoinHostPort(p.host, strconv.Itoa(p.port))
	body, _ := json.Marshal(pullRequest{EngineID: p.engineID, RequestID: p.requestID, Blocks: p.blocks})
	status, out, err := s.vkv.pull(ctx, addr, xid, body)
	if err != nil {
		return errorf(http.StatusInternalServerError, "KV transfer failed: prefill http://%s%s unreachable: %v", addr, pullPath, err)
	}
	var got struct {
		Digest  string `json:"digest"`
		Message string `json:"message"`
	}
	_ = json.Unmarshal(out, &got)
	switch {
	case status != http.StatusOK:
		return errorf(http.StatusInternalServerError, "KV transfer failed: prefill refused (%d): %s", status, got.Message)
	case got.Digest != digest:
		return errorf(http.StatusInternalServerError, "KV transfer failed: the KV pulled is another prompt's")
	}
	return nil
}

// pull sends one pull to addr and returns the reply's status and body. A
// kept connection that fails (the prefill closed it meanwhile) is dropped
// and the pull tried on the next, up to a fresh one.
func (k *vllmKV) pull(ctx context.Context, addr, xid string, body []byte) (int, []byte, error) {
	if strings.ContainsAny(xid, "\r\n") { // net/http refuses these: only a caller's bug gets here
		return 0, nil, errors.New("X-Request-Id holds a line break")
	}
	for {
		c, kept, err := k.conn(ctx, addr)
		if err != nil {
			return 0, nil, err
		}
		status, out, keep, err := c.roundTrip(ctx, addr, xid, body)
		if keep {
			k.put(addr, c)
		} else {
			_ = c.Close()
		}
		if err == nil || !kept || ctx.Err() != nil {
			return status, out, err
		}
	}
}

// conn is a kept connection to addr, or a new one (kept false).
func (k *vllmKV) conn(ctx context.Context, addr string) (c *pullConn, kept bool, err error) {
	k.mu.Lock()
	if idle := k.idle[addr]; len(idle) > 0 {
		c = idle[len(idle)-1]
		k.idle[addr] = idle[:len(idle)-1]
		k.mu.Unlock()
		return c, true, nil
	}
	k.mu.Unlock()
	d := net.Dialer{Timeout: pullTimeout}
	nc, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, false, err
	}
	return &pullConn{Conn: nc, br: bufio.NewReader(nc)}, false, nil
}

// put keeps c for the next pull to addr.
func (k *vllmKV) put(addr string, c *pullConn) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.idle == nil || len(k.idle[addr]) >= maxIdlePulls { // closed, or enough kept
		_ = c.Close()
		return
	}
	k.idle[addr] = append(k.idle[addr], c)
}

// closeIdle closes the kept connections; later ones are not kept.
func (k *vllmKV) closeIdle() {
	k.mu.Lock()
	defer k.mu.Unlock()
	for _, conns := range k.idle {
		for _, c := range conns {
			_ = c.Close()
		}
	}
	k.idle = nil
}

// roundTrip writes one pull and reads its reply; keep says whether c can
// carry the next.
func (c *pullConn) roundTrip(ctx context.Context, addr, xid string, body []byte) (status int, out []byte, keep bool, err error) {
	deadline := time.Now().Add(pullTimeout)
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	_ = c.SetDeadline(deadline)
	// A client that leaves ends its pull at once, as net/http's client did.
	stop := context.AfterFunc(ctx, func() { _ = c.SetDeadline(time.Unix(1, 0)) })
	defer func() {
		if !stop() {
			keep = false // the deadline above is in the past
		}
	}()
	req := make([]byte, 0, 192+len(addr)+len(xid)+len(body))
	req = append(append(append(req, "POST "+pullPath+" HTTP/1.1\r\nHost: "...), addr...), "\r\nUser-Agent: "+pullUserAgent+
		"\r\nContent-Type: application/json\r\nX-Request-Id: "...)
	req = append(append(append(req, xid...), "\r\nContent-Length: "...), strconv.Itoa(len(body))...)
	req = append(append(req, "\r\n\r\n"...), body...)
	if _, err = c.Write(req); err != nil {
		return 0, nil, false, err
	}
	resp, err := http.ReadResponse(c.br, nil)
	if err != nil {
		return 0, nil, false, err
	}
	out, err = io.ReadAll(io.LimitReader(resp.Body, maxPullReply+1))
	_ = resp.Body.Close()
	if err == nil && len(out) > maxPullReply {
		err = errPullReplyTooLarge
	}
	return resp.StatusCode, out, err == nil && !resp.Close, err
}
