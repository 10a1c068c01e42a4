// Package respond writes the replies the router makes itself, in
// sglang-router 0.3.x's shapes: JSON bodies, OpenAI-style errors and the
// worker API's errors. The request path (router), the info endpoints and
// the admin API share it, so each shape has one writer.
package respond

import (
	"encoding/json"
	"net/http"
	"strconv"

	"github.com/valyala/fasthttp"
)

// JSON sends v as a JSON body with status.
func JSON(ctx *fasthttp.RequestCtx, status int, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		Error{Status: 500, Code: "serialization_failed", Message: err.Error()}.Write(ctx)
		return
	}
	ctx.SetStatusCode(status)
	ctx.SetContentType("application/json")
	ctx.SetBody(b)
}

// AdminError is the worker API's error shape: {"error","code"}.
func AdminError(ctx *fasthttp.RequestCtx, status int, code, msg string) {
	JSON(ctx, status, map[string]string{"error": msg, "code": code})
}

// Error is a router-made error in OpenAI's shape.
type Error struct {
	Status  int
	Code    string // also the X-SMG-Error-Code header
	Message string
}

// Body renders {"error":{"message","type","code"}}.
func (e Error) Body() []byte {
	type inner struct {
		Message string `json:"message"`
		Type    string `json:"type"`
		Code    string `json:"code"`
	}
	b, _ := json.Marshal(struct {
		Error inner `json:"error"`
	}{inner{e.Message, errorType(e.Status), e.Code}})
	return b
}

// Write sends e as JSON with X-SMG-Error-Code, replacing any body.
func (e Error) Write(ctx *fasthttp.RequestCtx) {
	ctx.Response.ResetBody()
	ctx.SetStatusCode(e.Status)
	ctx.SetContentType("application/json")
	ctx.Response.Header.Set("X-SMG-Error-Code", e.Code)
	ctx.SetBody(e.Body())
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

// Upstream maps a worker's non-2xx reply the way sglang-router does
// (spec §2.6): a few statuses keep their own code, the rest become 500.
// side names the worker's role in the code ("prefill", "decode", "server").
func Upstream(side string, status int, body []byte) Error {
	e := Error{Status: status}
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

// NoWorkers is the 503 for an empty or unavailable pool of side's workers.
func NoWorkers(side string, total int) Error {
	msg := "No available " + side + " workers (all circuits open or unhealthy)"
	if total == 0 {
		msg = "No " + side + " workers available. Please check if " + side + " servers are configured and healthy."
	}
	return Error{Status: 503, Code: "server_selection_failed", Message: "No available servers: " + msg}
}

// RequireMethod answers 405 unless method is want; it reports whether the
// caller goes on.
func RequireMethod(ctx *fasthttp.RequestCtx, method, want string) bool {
	if method == want {
		return true
	}
	Error{Status: 405, Code: "method_not_allowed", Message: "method " + method + " not allowed; use " + want}.Write(ctx)
	return false
}
