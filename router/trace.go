package router

import (
	"context"
	"net"
	"strconv"
	"strings"
	"time"

	"github.com/valyala/fasthttp"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.40.0"
	"go.opentelemetry.io/otel/trace"
	"go.uber.org/zap"

	"github.com/pdrouter/pdrouter/balancer"
)

// OpenTelemetry traces (--enable-trace, --otlp-traces-endpoint, as smg).
// One server span per routed request, continuing the client's W3C
// traceparent if it sent one, with children:
//
//	select              one per worker picked (attempts and PD sides)
//	prefill / decode /  a client span per upstream leg, send to close;
//	worker                its id is the parent in the traceparent that leg carries
//	  first_byte        leg sent to the first byte reaching the client (the
//	                    decode or regular leg; a non-stream's whole reply)
//	  stream            first byte to the end of the stream
//
// Off (the default) the tracer is nil and so is every request's and leg's
// trace: each hook is a nil check, and nothing is allocated.

// DefaultOTLPTracesEndpoint is smg's default: an OTLP/gRPC collector.
const DefaultOTLPTracesEndpoint = "localhost:4317"

// TraceConfig is --enable-trace and --otlp-traces-endpoint.
type TraceConfig struct {
	Enabled bool
	// Endpoint is the OTLP/gRPC collector, host:port as smg takes it
	// (plain gRPC), or an http:// or https:// URL (https: TLS).
	Endpoint string
}

// validTrace checks the endpoint as smg does (host:port, port 1..65535),
// accepting a URL too; only when tracing is on.
func (c TraceConfig) validTrace() error {
	if !c.Enabled {
		return nil
	}
	host, port, err := net.SplitHostPort(c.hostPort())
	if err != nil || host == "" {
		return invalid("otlp_traces_endpoint %q: expected <host>:<port>, e.g. otel-collector:4317", c.Endpoint)
	}
	if p, err := strconv.Atoi(port); err != nil || p < 1 || p > 65535 {
		return invalid("otlp_traces_endpoint %q: port must be a number between 1 and 65535", c.Endpoint)
	}
	return nil
}

// hostPort is the collector's address, without the URL's scheme or path.
func (c TraceConfig) hostPort() string {
	hostPort := c.Endpoint
	for _, scheme := range []string{"http://", "https://"} {
		hostPort = strings.TrimPrefix(hostPort, scheme)
	}
	hostPort, _, _ = strings.Cut(hostPort, "/")
	return hostPort
}

// endpointURL is the endpoint as the gRPC exporter takes it: a bare
// host:port is plain gRPC, as smg sends it.
func (c TraceConfig) endpointURL() string {
	if strings.HasPrefix(c.Endpoint, "http://") || strings.HasPrefix(c.Endpoint, "https://") {
		return c.Endpoint
	}
	return "http://" + c.Endpoint
}

// tracer is the router's: nil when tracing is off.
type tracer struct {
	log      *zap.Logger
	provider *sdktrace.TracerProvider
	t        trace.Tracer
	prop     propagation.TraceContext

	exp       sdktrace.SpanExporter
	collector string // host:port
}

// newTracer starts the OTLP exporter (it connects lazily: a collector that
// is down costs dropped spans, never requests) or returns nil when off.
func newTracer(cfg TraceConfig, log *zap.Logger) (*tracer, error) {
	if !cfg.Enabled {
		return nil, nil
	}
	exp, err := otlptracegrpc.New(context.Background(), otlptracegrpc.WithEndpointURL(cfg.endpointURL()))
	if err != nil {
		return nil, err
	}
	// Export errors go to the log, not to stderr by the SDK's default.
	otel.SetErrorHandler(otel.ErrorHandlerFunc(func(err error) { log.Warn("trace export failed", zap.Error(err)) }))
	provider := sdktrace.NewTracerProvider(
		sdktrace.WithBatcher(exp, sdktrace.WithBatchTimeout(500*time.Millisecond), sdktrace.WithMaxExportBatchSize(64)),
		sdktrace.WithResource(resource.NewSchemaless(semconv.ServiceName("pdrouter"))),
	)
	return &tracer{log: log, provider: provider, t: provider.Tracer("github.com/pdrouter/pdrouter/router"),
		exp: exp, collector: cfg.hostPort()}, nil
}

// shutdown exports what is buffered, within a bounded time (the shutdown's
// own deadline may be spent by then); what it could not send is logged. A
// collector that does not take a connection gets no wait: the exporter
// would spend all of it retrying (5 s added to every shutdown), so it is
// shut first, which ends the export it is retrying.
func (t *tracer) shutdown() {
	if t == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if c, err := net.DialTimeout("tcp", t.collector, 250*time.Millisecond); err == nil {
		c.Close()
	} else {
		// Past this the exporter cancels the exports under way.
		stop, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
		defer cancel()
		t.exp.Shutdown(stop) //nolint:errcheck // the provider's shutdown says what was lost
	}
	if err := t.provider.Shutdown(ctx); err != nil {
		t.log.Warn("traces not exported at shutdown", zap.Error(err))
	}
}

// reqTrace is one request's span.
type reqTrace struct {
	t    *tracer
	ctx  context.Context // holds span
	span trace.Span
	rctx *fasthttp.RequestCtx // for the status the client got, at the end

	status int   // the client's, once responded (record.responded)
	cause  error // why the request was cut short, if it was
}

// start opens r's span, a child of the client's traceparent if any.
func (t *tracer) start(ctx *fasthttp.RequestCtx, r *request) *reqTrace {
	if t == nil {
		return nil
	}
	parent := t.prop.Extract(context.Background(), (*requestCarrier)(&ctx.Request.Header))
	c, span := t.t.Start(parent, "POST "+r.path, trace.WithSpanKind(trace.SpanKindServer), trace.WithTimestamp(r.start),
		trace.WithAttributes(semconv.HTTPRequestMethodKey.String("POST"), semconv.HTTPRoute(r.path),
			attribute.String("pdrouter.request_id", string(r.requestID))))
	return &reqTrace{t: t, ctx: c, span: span, rctx: ctx}
}

// end closes the request's span as its record is emitted, at the time the
// client's response was complete (record.responded): with the status the
// client got, and why the request was cut short if it was.
func (rt *reqTrace) end(r *request) {
	if rt == nil {
		return
	}
	status := rt.status
	rt.span.SetAttributes(semconv.HTTPResponseStatusCode(status), attribute.Bool("pdrouter.stream", r.info.Stream))
	if cause := rt.cause; cause != nil {
		rt.span.SetAttributes(attribute.String("pdrouter.cancelled", cause.Error()))
		rt.span.SetStatus(codes.Error, cause.Error())
	} else if status >= 500 {
		rt.span.SetStatus(codes.Error, strconv.Itoa(status))
	}
	rt.span.End(trace.WithTimestamp(r.start.Add(r.rec.took)))
}

// now is the start of a selection, when traced.
func (rt *reqTrace) now() time.Time {
	if rt == nil {
		return time.Time{}
	}
	return time.Now()
}

// selected records one worker selection that began at start.
func (rt *reqTrace) selected(start time.Time, w *balancer.Worker, policy string) {
	if rt == nil {
		return
	}
	_, span := rt.t.t.Start(rt.ctx, "select", trace.WithTimestamp(start), trace.WithAttributes(
		attribute.String("pdrouter.worker_type", w.Type.String()), attribute.String("pdrouter.worker", w.URL),
		attribute.String("pdrouter.policy", policy)))
	span.End()
}

// leg is the trace of a leg about to be opened; nil when not traced.
func (rt *reqTrace) leg() *legSpan {
	if rt == nil {
		return nil
	}
	return &legSpan{rt: rt}
}

// legSpan is one upstream leg's span and its first byte and stream spans.
type legSpan struct {
	rt     *reqTrace
	ctx    context.Context
	span   trace.Span
	sent   time.Time
	stream trace.Span
}

// start opens the leg's span as l is sent and returns the header lines it
// goes with: the client's, less any traceparent and tracestate of the
// client's, plus the leg's own.
func (ls *legSpan) start(l *leg, path string, header []byte) []byte {
	if ls == nil {
		return header
	}
	ls.sent = time.Now()
	ls.ctx, ls.span = ls.rt.t.t.Start(ls.rt.ctx, l.w.Type.String(), trace.WithSpanKind(trace.SpanKindClient),
		trace.WithTimestamp(ls.sent), trace.WithAttributes(attribute.String("pdrouter.worker", l.w.URL),
			semconv.URLPath(path)))
	out := &headerLines{b: withoutTraceContext(make([]byte, 0, len(header)+128), header)}
	ls.rt.t.prop.Inject(ls.ctx, out)
	return out.b
}

// firstByte records the leg's time to first byte and, for a stream, opens
// the stream's span.
func (ls *legSpan) firstByte(stream bool) {
	if ls == nil || ls.span == nil {
		return
	}
	now := time.Now()
	_, fb := ls.rt.t.t.Start(ls.ctx, "first_byte", trace.WithTimestamp(ls.sent))
	fb.End(trace.WithTimestamp(now))
	if stream {
		_, ls.stream = ls.rt.t.t.Start(ls.ctx, "stream", trace.WithTimestamp(now))
	}
}

// end closes the leg's spans as the leg closes, with its outcome.
func (ls *legSpan) end(l *leg) {
	if ls == nil || ls.span == nil {
		return
	}
	switch {
	case l.resp != nil:
		status := l.resp.StatusCode
		ls.span.SetAttributes(semconv.HTTPResponseStatusCode(status))
		if l.broke {
			ls.span.SetStatus(codes.Error, "reply broke off")
		} else if status/100 != 2 {
			ls.span.SetStatus(codes.Error, strconv.Itoa(status))
		}
	case l.blame:
		ls.span.SetStatus(codes.Error, "no reply")
	}
	if l.resp == nil || !l.resp.eof {
		if cause := l.sc.Cause(); cause != nil {
			ls.span.SetAttributes(attribute.String("pdrouter.cancelled", cause.Error()))
		}
	}
	if ls.stream != nil {
		ls.stream.End()
	}
	ls.span.End()
}

// requestCarrier reads the client's trace context headers.
type requestCarrier fasthttp.RequestHeader

func (c *requestCarrier) Get(key string) string {
	return string((*fasthttp.RequestHeader)(c).Peek(key))
}
func (c *requestCarrier) Set(string, string) {}
func (c *requestCarrier) Keys() []string     { return nil }

// headerLines collects injected headers as "Name: value\r\n" lines.
type headerLines struct{ b []byte }

func (h *headerLines) Get(string) string { return "" }
func (h *headerLines) Set(key, value string) {
	h.b = appendHeader(h.b, []byte(key), []byte(value))
}
func (h *headerLines) Keys() []string { return nil }

// withoutTraceContext appends header's lines to dst, less traceparent and
// tracestate (the leg carries its own).
func withoutTraceContext(dst, header []byte) []byte {
	for len(header) > 0 {
		line := header
		if end := strings.Index(bstr(header), "\r\n"); end >= 0 {
			line = header[:end+2]
		}
		header = header[len(line):]
		name, _, _ := strings.Cut(bstr(line), ":")
		if strings.EqualFold(name, "traceparent") || strings.EqualFold(name, "tracestate") {
			continue
		}
		dst = append(dst, line...)
	}
	return dst
}
