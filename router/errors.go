package router

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/valyala/fasthttp"

	"github.com/pdrouter/pdrouter/router/respond"
)

// Why a request's or an attempt's scope ended, besides context.Canceled
// (the last reference released, or hard shutdown).
var (
	// errClientGone cancels upstream legs when the client disconnects.
	errClientGone = errors.New("client disconnected")
	// errRequestTimeout ends a request at --request-timeout-secs; it is a
	// context.DeadlineExceeded so callers can tell a timeout from a failure.
	errRequestTimeout = fmt.Errorf("request timed out: %w", context.DeadlineExceeded)
	// errPrefillFailed ends a PD attempt whose prefill leg failed.
	errPrefillFailed = errors.New("prefill leg failed")
	// errAttemptOver ends a PD attempt that is abandoned for another reason.
	errAttemptOver = errors.New("attempt abandoned")
	// errShuttingDown ends what is left when the shutdown grace period ends.
	errShuttingDown = errors.New("the router is shutting down")
)

// shuttingDown is what a client cut off by the shutdown is told.
func shuttingDown() *apiError {
	return &apiError{Status: 503, Code: "server_shutting_down", Message: "the router is shutting down"}
}

// errUpstreamClosed is a keep-alive connection the worker had closed.
var errUpstreamClosed = errors.New("worker closed the connection")

// errStreamIdle is a worker's stream silent for --stream-idle-timeout-secs;
// it also ends the request's scope, so that both legs' engines abort.
var errStreamIdle = errors.New("no data from the worker within the stream idle timeout")

// apiError is a router-made error in sglang-router 0.3.x's OpenAI-style shape.
type apiError struct {
	Status  int
	Code    string
	Message string

	sse     bool   // render as one SSE event (the client asked for a stream)
	raw     []byte // a worker's own error reply, passed through as is
	rawType string // its content type
}

func (e *apiError) Error() string { return e.Message }

func (e *apiError) fields() respond.Error {
	return respond.Error{Status: e.Status, Code: e.Code, Message: e.Message}
}

// sseFrame renders the error as one valid SSE event.
func (e *apiError) sseFrame() []byte {
	b := append([]byte("data: "), e.fields().Body()...)
	return append(b, "\n\n"...)
}

// writeError sends e as JSON with X-SMG-Error-Code.
func writeError(ctx *fasthttp.RequestCtx, e *apiError) { e.fields().Write(ctx) }

// write sends a failure to the client: a router-made JSON error, an SSE
// error frame for streams, or an upstream reply passed through.
func (e *apiError) write(ctx *fasthttp.RequestCtx) {
	switch {
	case e.raw != nil:
		ctx.SetStatusCode(e.Status)
		if e.rawType != "" {
			ctx.SetContentType(e.rawType)
		}
		ctx.SetBody(e.raw)
	case e.sse:
		ctx.SetStatusCode(e.Status)
		ctx.SetContentType("text/event-stream")
		ctx.Response.Header.Set("X-SMG-Error-Code", e.Code)
		ctx.SetBody(e.sseFrame())
	default:
		writeError(ctx, e)
	}
}

func badRequest(msg string) *apiError {
	return &apiError{Status: 400, Code: "json_parse_error", Message: msg}
}

// upstreamError maps a worker's non-2xx reply (respond.Upstream). An
// engine's failure (5xx) about the KV transfer is told as such and no
// more: its words name the kvproxy's control socket and internal bootstrap
// addresses, which are no business of the client's (the engine logs them).
func upstreamError(side string, status int, body []byte) *apiError {
	e := respond.Upstream(side, status, body)
	if status >= 500 && aboutKVTransfer(e.Message) {
		return &apiError{Status: e.Status, Code: "kv_transfer_failed",
			Message: "KV transfer between prefill and decode failed (reported by " + side + ")"}
	}
	return &apiError{Status: e.Status, Code: e.Code, Message: e.Message}
}

// kvMarkers are what the engines' errors about the KV transfer say:
// SGLang's ("KVTransferError", "bootstrap failed", "transfer failed"),
// kvproxy's client's and the mock engine's.
var kvMarkers = []string{"kv transfer", "kvtransfer", "kvproxy", "bootstrap", "transfer failed"}

func aboutKVTransfer(msg string) bool {
	msg = strings.ToLower(msg)
	for _, m := range kvMarkers {
		if strings.Contains(msg, m) {
			return true
		}
	}
	return false
}

// selectionError is the 503 for an empty or unavailable pool.
func selectionError(side string, total int) *apiError {
	e := respond.NoWorkers(side, total)
	return &apiError{Status: e.Status, Code: e.Code, Message: e.Message}
}

// transportError answers what fasthttp could not read as a request.
func (s *Server) transportError(ctx *fasthttp.RequestCtx, err error) {
	s.setRequestID(ctx)
	if errors.Is(err, fasthttp.ErrBodyTooLarge) { // PD mode: fasthttp reads the body
		writeError(ctx, s.tooLarge())
		return
	}
	writeError(ctx, malformed(err))
}
