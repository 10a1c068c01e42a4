package main

import (
	"net"
	"testing"

	"github.com/valyala/fasthttp"
)

func serve(t *testing.T, h fasthttp.RequestHandler) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &fasthttp.Server{Handler: h}
	go srv.Serve(ln) //nolint:errcheck // ends at Shutdown
	t.Cleanup(func() { _ = srv.Shutdown() })
	return ln.Addr().String()
}

func TestForwardsRequestAndReply(t *testing.T) {
	backend := serve(t, func(ctx *fasthttp.RequestCtx) {
		ctx.SetStatusCode(201)
		ctx.Response.Header.Set("X-Path", string(ctx.Path()))
		ctx.SetBody(append([]byte("echo:"), ctx.PostBody()...))
	})
	proxy := serve(t, newHandler(backend))
	for range 3 { // the second and third reuse the kept-alive connection
		code, body, err := fasthttp.Post(nil, "http://"+proxy+"/generate", &fasthttp.Args{})
		if err != nil {
			t.Fatal(err)
		}
		if code != 201 || string(body) != "echo:" {
			t.Fatalf("got %d %q", code, body)
		}
	}
	req, resp := fasthttp.AcquireRequest(), fasthttp.AcquireResponse()
	req.SetRequestURI("http://" + proxy + "/v1/completions")
	req.Header.SetMethod("POST")
	req.SetBodyString(`{"prompt":"x"}`)
	if err := fasthttp.Do(req, resp); err != nil {
		t.Fatal(err)
	}
	if got := string(resp.Header.Peek("X-Path")); got != "/v1/completions" || string(resp.Body()) != `echo:{"prompt":"x"}` {
		t.Fatalf("path %q body %q", got, resp.Body())
	}
}

func TestDeadBackendIs502(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := ln.Addr().String()
	ln.Close()
	proxy := serve(t, newHandler(dead))
	code, _, err := fasthttp.Get(nil, "http://"+proxy+"/")
	if err != nil || code != 502 {
		t.Fatalf("got %d %v, want 502", code, err)
	}
}
