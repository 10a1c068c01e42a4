// Command fastproxy is a baseline for make bench: the least a reverse proxy
// built on fasthttp (pdrouter's HTTP library) can do per request, with
// none of the router's work (no body inspection, policy, metrics, request
// ids, disconnect watch or cancellation). Its requests/s and CPU per
// request, measured in the same run as pdrouter and nginx, separate what
// the library and the Go runtime cost on this machine from what pdrouter
// adds on top.
package main

import (
	"flag"
	"fmt"
	"net"
	"os"

	"github.com/valyala/fasthttp"
)

func main() {
	listen := flag.String("listen", "127.0.0.1:0", "address to serve on")
	backend := flag.String("backend", "", "host:port of the one backend")
	flag.Parse()
	if *backend == "" {
		fmt.Fprintln(os.Stderr, "fastproxy: --backend is required")
		os.Exit(2)
	}
	ln, err := net.Listen("tcp", *listen)
	if err != nil {
		fmt.Fprintln(os.Stderr, "fastproxy:", err)
		os.Exit(1)
	}
	if err := (&fasthttp.Server{Handler: newHandler(*backend)}).Serve(ln); err != nil {
		fmt.Fprintln(os.Stderr, "fastproxy:", err)
		os.Exit(1)
	}
}

// newHandler forwards every request to backend over keep-alive connections
// and returns the reply as read.
func newHandler(backend string) fasthttp.RequestHandler {
	client := &fasthttp.HostClient{Addr: backend, MaxConns: 1024}
	return func(ctx *fasthttp.RequestCtx) {
		ctx.Request.Header.Del("Connection")
		if err := client.Do(&ctx.Request, &ctx.Response); err != nil {
			ctx.Error(err.Error(), fasthttp.StatusBadGateway)
		}
	}
}
