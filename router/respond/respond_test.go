package respond

import (
	"testing"

	"github.com/valyala/fasthttp"
)

func TestErrorShape(t *testing.T) {
	var ctx fasthttp.RequestCtx
	ctx.SetBodyString("partial reply")
	Error{Status: 400, Code: "json_parse_error", Message: `bad "json"`}.Write(&ctx)
	want := `{"error":{"message":"bad \"json\"","type":"invalid_request_error","code":"json_parse_error"}}`
	if got := string(ctx.Response.Body()); got != want || ctx.Response.StatusCode() != 400 ||
		string(ctx.Response.Header.Peek("X-SMG-Error-Code")) != "json_parse_error" {
		t.Errorf("%d %s %q", ctx.Response.StatusCode(), got, ctx.Response.Header.Peek("X-SMG-Error-Code"))
	}
	if got := string(Error{Status: 599}.Body()); got != `{"error":{"message":"","type":"Error","code":""}}` {
		t.Errorf("unknown status: %s", got)
	}
}

func TestUpstreamMapping(t *testing.T) {
	for _, c := range []struct {
		side       string
		status     int
		body       string
		wantStatus int
		code, msg  string
	}{
		{"decode", 503, `{"error":{"message":"overloaded"}}`, 503, "decode_unavailable", "overloaded"},
		{"decode", 418, `{"error":"teapot"}`, 500, "decode_error", "teapot"},
		{"server", 400, `{"message":"no"}`, 400, "server_bad_request", "no"},
		{"prefill", 500, `not json`, 500, "prefill_internal_error", "Prefill server error (500): not json"},
	} {
		e := Upstream(c.side, c.status, []byte(c.body))
		if e.Status != c.wantStatus || e.Code != c.code || e.Message != c.msg {
			t.Errorf("%s %d %s: %+v", c.side, c.status, c.body, e)
		}
	}
	if e := NoWorkers("decode", 0); e.Status != 503 || e.Code != "server_selection_failed" {
		t.Errorf("%+v", e)
	}
}
