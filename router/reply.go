package router

import (
	"io"

	"github.com/valyala/fasthttp"
)

// reply makes the 2xx reply of l, the request's leg, the client's: as a
// stream (stream.go), or read whole here. Regular mode and PD share it; a is
// the PD attempt (nil in regular mode), whose prefill may have failed or
// have logprobs to merge. It returns what pdAttempt and regularAttempt do.
func (s *Server) reply(ctx *fasthttp.RequestCtx, r *request, l *leg, a *attempt) (*apiError, bool) {
	if r.info.Stream {
		return s.startStream(ctx, r, l, a)
	}
	return s.replyWhole(ctx, r, l, a), false
}

// replyWhole is reply for a non-stream. Apart, so that reply's frame is
// small on the stack of a stream waiting for its first token
// (streamconn.go).
func (s *Server) replyWhole(ctx *fasthttp.RequestCtx, r *request, l *leg, a *attempt) *apiError {
	defer l.close()
	if err := readReply(ctx, l.resp); err != nil {
		l.bodyFailed()
		if f := a.failure(); f != nil {
			return f
		}
		a.abandon()
		if r.clientGone() {
			return nil
		}
		side := "worker"
		if a != nil {
			side = "decode"
		}
		return &apiError{Status: 502, Code: "read_response_failed", Message: "Failed to read " + side + " response: " + err.Error()}
	}
	a.scanWhole(ctx.Response.Body())
	if prefill, ok := a.logprobs(r); ok {
		ctx.SetBody(mergeLogprobsJSON(prefill, ctx.Response.Body()))
	}
	r.observeFirstByte()
	return nil
}

// readReply makes a worker's complete reply the client's: status, headers,
// and the body read into the response's own (pooled) buffer.
func readReply(ctx *fasthttp.RequestCtx, resp *upstreamResponse) error {
	ctx.Response.ResetBody()
	bufp := chunkPool.Get().(*[]byte)
	defer chunkPool.Put(bufp)
	for {
		n, err := resp.Read(*bufp)
		ctx.Response.AppendBody((*bufp)[:n])
		if err == io.EOF {
			break
		}
		if err != nil {
			ctx.Response.ResetBody()
			return err
		}
	}
	ctx.SetStatusCode(resp.StatusCode)
	copyHeaders(ctx, resp)
	return nil
}

// hopHeader reports the headers not copied from a worker's reply; fasthttp
// sets its own framing headers. A switch, not a map: it costs no hash per
// header of every reply. Names arrive normalized (fasthttp's parser).
func hopHeader(name string) bool {
	switch name {
	case "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization",
		"Te", "Trailer", "Trailers", "Transfer-Encoding", "Upgrade",
		"Content-Encoding", "Host", "Content-Length", "Date", "Server",
		"X-Request-Id":
		return true
	}
	return false
}

func copyHeaders(ctx *fasthttp.RequestCtx, resp *upstreamResponse) {
	if resp.Header == &spentH2CHead { // packed (packHead)
		for b := resp.fields; len(b) > 0; {
			var k, v []byte
			k, b = packedField(b)
			v, b = packedField(b)
			ctx.Response.Header.AddBytesKV(k, v)
		}
		return
	}
	for k, v := range resp.Header.All() {
		switch name := bstr(k); {
		case name == "Content-Type":
			// What AddBytesKV does with it, less normalizing the name again.
			ctx.Response.Header.SetContentTypeBytes(v)
		case !hopHeader(name):
			ctx.Response.Header.AddBytesKV(k, v)
		}
	}
}
