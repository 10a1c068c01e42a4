package router

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"

	"github.com/valyala/fasthttp"
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
)

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

// body renders {"error":{"message","type","code"}}.
func (e *apiError) body() []byte {
	b, _ := json.Marshal(struct {
		Error struct {
			Message string `json:"message"`
			Type    string `json:"type"`
			Code    string `json:"code"`
		} `json:"error"`
	}{Error: struct {
		Message string `json:"message"`
		Type    string `json:"type"`
		Code    string `json:"code"`
	}{e.Message, errorType(e.Status), e.Code}})
	return b
}

// sseFrame renders the error as one valid SSE event.
func (e *apiError) sseFrame() []byte {
	b := append([]byte("data: "), e.body()...)
	return append(b, "\n\n"...)
}

// errorType is the OpenAI "type": invalid_request_error for client faults,
// the canonical reason phrase otherwise (as sglang-router does).
func errorType(status int) string {
	if status == http.StatusBadRequest || status == http.StatusUnprocessableEntity {
		return "invalid_request_error"
	}
	if t := http.StatusText(status); t != "" {
		return t
	}
	return "Error"
}

// writeError sends e as JSON with X-SMG-Error-Code.
func writeError(ctx *fasthttp.RequestCtx, e *apiError) {
	ctx.Response.ResetBody()
	ctx.SetStatusCode(e.Status)
	ctx.SetContentType("application/json")
	ctx.Response.Header.Set("X-SMG-Error-Code", e.Code)
	ctx.SetBody(e.body())
}

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

// upstreamError maps a worker's non-2xx reply the way sglang-router does
// (spec §2.6): a few statuses keep their own code, the rest become 500.
func upstreamError(side string, status int, body []byte) *apiError {
	e := &apiError{Status: status}
	switch status {
	case 400:
		e.Code = side + "_bad_request"
	case 404:
		e.Code = side + "_not_found"
	case 500:
		e.Code = side + "_internal_error"
	case 502:
		e.Code = side + "_bad_gateway"
	case 503:
		e.Code = side + "_unavailable"
	default:
		e.Status, e.Code = 500, side+"_error"
	}
	msg := upstreamMessage(body)
	if side == "prefill" {
		msg = "Prefill server error (" + strconv.Itoa(status) + "): " + msg
	}
	e.Message = msg
	return e
}

// upstreamMessage pulls error.message, else message, else the raw body.
func upstreamMessage(body []byte) string {
	var v struct {
		Error   json.RawMessage `json:"error"`
		Message string          `json:"message"`
	}
	if json.Unmarshal(body, &v) == nil {
		var inner struct {
			Message string `json:"message"`
		}
		if len(v.Error) > 0 && json.Unmarshal(v.Error, &inner) == nil && inner.Message != "" {
			return inner.Message
		}
		var s string
		if len(v.Error) > 0 && json.Unmarshal(v.Error, &s) == nil && s != "" {
			return s
		}
		if v.Message != "" {
			return v.Message
		}
	}
	return string(body)
}

// selectionError is the 503 for an empty or unavailable pool.
func selectionError(side string, total int) *apiError {
	msg := "No available " + side + " workers (all circuits open or unhealthy)"
	if total == 0 {
		msg = "No " + side + " workers available. Please check if " + side + " servers are configured and healthy."
	}
	return &apiError{Status: 503, Code: "server_selection_failed", Message: "No available servers: " + msg}
}

// adminError is the worker API's error shape: {"error","code"}.
func adminError(ctx *fasthttp.RequestCtx, status int, code, msg string) {
	writeJSON(ctx, status, map[string]string{"error": msg, "code": code})
}

// transportError answers what fasthttp could not read as a request.
func (s *Server) transportError(ctx *fasthttp.RequestCtx, err error) {
	s.setRequestID(ctx)
	if errors.Is(err, fasthttp.ErrBodyTooLarge) {
		writeError(ctx, &apiError{Status: 413, Code: "payload_too_large",
			Message: fmt.Sprintf("request body exceeds the limit of %d bytes", s.cfg.MaxPayloadSize)})
		return
	}
	writeError(ctx, malformed(err))
}
