package mockworker

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"time"
)

// Role is the disaggregation role the mock plays.
type Role string

const (
	RoleRegular Role = "regular"
	RolePrefill Role = "prefill"
	RoleDecode  Role = "decode"
)

// Defaults applied by New to zero fields of Config.
const (
	DefaultTokens        = 16
	DefaultModel         = "mock"
	DefaultHost          = "127.0.0.1"
	DefaultBootstrapPort = 8998 // SGLang's --disaggregation-bootstrap-port default
	DefaultRecordLimit   = 1000
)

// Config configures a mock worker. Zero values mean the documented defaults.
type Config struct {
	Role     Role   // "" = regular
	Host     string // "" = 127.0.0.1
	Port     int    // 0 = ephemeral
	WorkerID string // "" = worker-PORT (the bound port)
	Model    string // served model name; "" = mock

	// APIKey, when set, must be presented as "Authorization: Bearer KEY".
	// RequireAPIKey alone accepts any Bearer token.
	APIKey        string
	RequireAPIKey bool

	Tokens       int           // completion tokens per request; 0 = 16. Requests may lower it.
	TokenDelay   time.Duration // between two tokens
	PrefillDelay time.Duration // before the first byte of a generation response

	StatusCode     int     // non-zero and not 200: every generation request fails with it
	FailFirstN     int     // the first N generation requests fail with 500
	RandomFailRate float64 // probability in [0,1] of a 500
	CrashOnRequest bool    // exit(1) on the first generation request
	Hang           bool    // never answer generation requests; wait for the client to go

	HealthFailAfter time.Duration // /health answers 503 once this much time has passed
	HealthFlap      time.Duration // /health alternates 200 and 503 every period
	Seed            int64         // random-fail-rate seed; 0 = time-based

	// BootstrapPort is used for a JSON-null bootstrap_port, like SGLang's
	// --disaggregation-bootstrap-port. 0 = 8998.
	BootstrapPort int
	// RecordLimit is how many generation requests /_mock/requests keeps;
	// 0 = 1000, negative = record nothing (for benchmarks with big bodies).
	RecordLimit int
	// NoV1Loads answers GET /v1/loads 404, as an engine older than it.
	NoV1Loads bool
	// NoServerInfo answers GET /server_info 404 (only /get_server_info, as
	// older SGLang); NoDPSize leaves dp_size out of both.
	NoServerInfo, NoDPSize bool
	// FailDPRank, when set, fails with 500 every generation request that
	// runs on that DP rank (one sick rank of an engine).
	FailDPRank *int
	// Engine is what /server_info reports of the engine's layout; zero
	// fields are DefaultEngine's.
	Engine EngineInfo

	KV KVTransfer // nil = no KV transfer
	// VLLMKVTimeout is how long a vllm-prefill keeps a request's KV for its
	// decode (vllm.go); 0 = DefaultVLLMKVTimeout.
	VLLMKVTimeout time.Duration
	// ReportTransferMS > 0 with no KV: report a transfer of this many ms
	// (kv_transfer.transfer_ms) without moving anything, for routers'
	// KV transfer metrics.
	ReportTransferMS float64

	TLS *TLS // nil = plain HTTP
	// HTTP2 serves HTTP/2 cleartext (prior knowledge) beside HTTP/1.1 on
	// the same port and reports enable_http2 in /server_info, as SGLang's
	// --enable-http2.
	HTTP2 bool

	// Exit is called for CrashOnRequest; nil = os.Exit. Tests replace it.
	Exit func(code int)
}

// EngineInfo is the layout a PD pair must agree on for KV to move, as
// SGLang's /server_info names it (the doctor compares them).
type EngineInfo struct {
	PageSize        int    // page_size
	KVCacheDtype    string // kv_cache_dtype
	TPSize          int    // tp_size
	DPSize          int    // dp_size: the ranks requests may name (see dp.go)
	TransferBackend string // disaggregation_transfer_backend
}

// DefaultEngine is SGLang's defaults.
var DefaultEngine = EngineInfo{PageSize: 1, KVCacheDtype: "auto", TPSize: 1, DPSize: 1, TransferBackend: "mooncake"}

func (e EngineInfo) withDefaults() EngineInfo {
	d := DefaultEngine
	if e.PageSize != 0 {
		d.PageSize = e.PageSize
	}
	if e.KVCacheDtype != "" {
		d.KVCacheDtype = e.KVCacheDtype
	}
	if e.TPSize != 0 {
		d.TPSize = e.TPSize
	}
	if e.DPSize != 0 {
		d.DPSize = e.DPSize
	}
	if e.TransferBackend != "" {
		d.TransferBackend = e.TransferBackend
	}
	return d
}

func (c Config) withDefaults() (Config, error) {
	c.Engine = c.Engine.withDefaults()
	if c.Role == "" {
		c.Role = RoleRegular
	}
	switch c.Role {
	case RoleRegular, RolePrefill, RoleDecode, RoleVLLMPrefill, RoleVLLMDecode:
	default:
		return c, fmt.Errorf("invalid role %q: want prefill, decode, regular, vllm-prefill or vllm-decode", c.Role)
	}
	if c.VLLMKVTimeout == 0 {
		c.VLLMKVTimeout = DefaultVLLMKVTimeout
	}
	if c.Host == "" {
		c.Host = DefaultHost
	}
	if c.Model == "" {
		c.Model = DefaultModel
	}
	if c.Tokens == 0 {
		c.Tokens = DefaultTokens
	}
	if c.BootstrapPort == 0 {
		c.BootstrapPort = DefaultBootstrapPort
	}
	if c.RecordLimit == 0 {
		c.RecordLimit = DefaultRecordLimit
	}
	if c.Exit == nil {
		c.Exit = os.Exit
	}
	switch {
	case c.Port < 0 || c.Port > 65535:
		return c, fmt.Errorf("invalid port %d", c.Port)
	case c.Engine.PageSize < 0 || c.Engine.TPSize < 0 || c.Engine.DPSize < 0:
		return c, errors.New("page-size, tp-size and dp-size must not be negative")
	case c.Engine.DPSize > maxDPSize:
		return c, fmt.Errorf("dp-size %d: at most %d", c.Engine.DPSize, maxDPSize)
	case c.Tokens < 0:
		return c, fmt.Errorf("invalid tokens %d", c.Tokens)
	case c.TokenDelay < 0 || c.PrefillDelay < 0 || c.HealthFailAfter < 0 || c.HealthFlap < 0 || c.VLLMKVTimeout < 0:
		return c, errors.New("durations must not be negative")
	case c.StatusCode != 0 && (c.StatusCode < 100 || c.StatusCode > 599):
		return c, fmt.Errorf("invalid status code %d", c.StatusCode)
	case c.FailFirstN < 0:
		return c, fmt.Errorf("invalid fail-first-n %d", c.FailFirstN)
	case c.ReportTransferMS < 0:
		return c, fmt.Errorf("invalid report-transfer-ms %v", c.ReportTransferMS)
	case c.RandomFailRate < 0 || c.RandomFailRate > 1:
		return c, fmt.Errorf("invalid random-fail-rate %v: want [0,1]", c.RandomFailRate)
	}
	if c.KV == nil && c.ReportTransferMS > 0 {
		c.KV = reportedKV(c.ReportTransferMS)
	}
	return c, nil
}

// ParseFlags parses the mockworker command line into a Config. It returns
// flag.ErrHelp for -h/--help.
func ParseFlags(name string, args []string, output io.Writer) (Config, error) {
	var c Config
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(output)
	role := fs.String("role", string(RoleRegular), "prefill, decode or regular (SGLang), vllm-prefill or vllm-decode (vLLM with a KV connector)")
	fs.DurationVar(&c.VLLMKVTimeout, "vllm-kv-timeout", 0, "vllm-prefill: how long a request's KV waits for its decode (0 = 480s, vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT)")
	fs.StringVar(&c.Host, "host", DefaultHost, "listen host")
	fs.IntVar(&c.Port, "port", -1, "listen port (required; 0 = ephemeral)")
	fs.StringVar(&c.WorkerID, "worker-id", "", "worker id in X-Worker-Id and bodies (default worker-PORT)")
	fs.StringVar(&c.Model, "model", DefaultModel, "served model name")
	fs.StringVar(&c.APIKey, "api-key", "", "require this Bearer token")
	fs.BoolVar(&c.RequireAPIKey, "require-api-key", false, "require a Bearer token")
	fs.IntVar(&c.Tokens, "tokens", DefaultTokens, "completion tokens to emit (requests may lower it)")
	fs.DurationVar(&c.TokenDelay, "token-delay", 0, "delay between tokens")
	fs.DurationVar(&c.PrefillDelay, "prefill-delay", 0, "delay before the first byte of a generation response")
	fs.IntVar(&c.StatusCode, "status-code", 0, "answer every generation request with this status and an SGLang error body")
	fs.IntVar(&c.FailFirstN, "fail-first-n", 0, "fail the first N generation requests with 500")
	fs.Float64Var(&c.RandomFailRate, "random-fail-rate", 0, "probability of a 500 per generation request")
	fs.BoolVar(&c.CrashOnRequest, "crash-on-request", false, "exit(1) on the first generation request")
	fs.BoolVar(&c.Hang, "hang", false, "never answer generation requests")
	fs.DurationVar(&c.HealthFailAfter, "health-fail-after", 0, "/health returns 503 after this long")
	fs.DurationVar(&c.HealthFlap, "health-flap", 0, "/health alternates 200/503 with this period")
	fs.Int64Var(&c.Seed, "seed", 0, "random seed (0 = time-based)")
	fs.IntVar(&c.BootstrapPort, "bootstrap-port", DefaultBootstrapPort, "bootstrap port assumed for a null bootstrap_port")
	fs.IntVar(&c.RecordLimit, "record-requests", DefaultRecordLimit, "generation requests kept for /_mock/requests (negative = none)")
	fs.Float64Var(&c.ReportTransferMS, "report-transfer-ms", 0, "report a KV transfer of this many ms in kv_transfer (none is made) when no KV engine is attached")
	fs.BoolVar(&c.NoV1Loads, "no-v1-loads", false, "answer GET /v1/loads 404 (an engine with /get_load only)")
	fs.BoolVar(&c.NoServerInfo, "no-server-info", false, "answer GET /server_info 404 (an engine with /get_server_info only)")
	fs.BoolVar(&c.NoDPSize, "no-dp-size", false, "leave dp_size out of /server_info and /get_server_info")
	failRank := fs.Int("fail-dp-rank", -1, "answer 500 to generation requests run on this DP rank (-1 = none)")
	fs.IntVar(&c.Engine.PageSize, "page-size", 0, "page_size in /server_info (default 1)")
	fs.StringVar(&c.Engine.KVCacheDtype, "cache-dtype", "", "kv_cache_dtype in /server_info (default auto; not --kv-…, which cmd/mockworker gives the KV engine)")
	fs.IntVar(&c.Engine.TPSize, "tp-size", 0, "tp_size in /server_info (default 1)")
	fs.IntVar(&c.Engine.DPSize, "dp-size", 0, "dp_size in /server_info, the DP ranks requests may name (default 1)")
	fs.StringVar(&c.Engine.TransferBackend, "transfer-backend", "", "disaggregation_transfer_backend in /server_info (default mooncake)")
	var tlsFlags TLS
	fs.BoolVar(&c.HTTP2, "enable-http2", false, "serve h2c (HTTP/2 cleartext) beside HTTP/1.1 and report enable_http2 in /server_info")
	fs.StringVar(&tlsFlags.CertFile, "tls-cert", "", "serve HTTPS with this PEM certificate (needs --tls-key)")
	fs.StringVar(&tlsFlags.KeyFile, "tls-key", "", "PEM private key of --tls-cert")
	fs.StringVar(&tlsFlags.ClientCAFile, "tls-client-ca", "", "require client certificates signed by this PEM CA (mTLS)")
	if err := fs.Parse(args); err != nil {
		return c, err
	}
	if tlsFlags != (TLS{}) {
		if tlsFlags.CertFile == "" || tlsFlags.KeyFile == "" {
			return c, errors.New("--tls-cert and --tls-key go together (and --tls-client-ca needs them)")
		}
		c.TLS = &tlsFlags
	}
	if fs.NArg() > 0 {
		return c, fmt.Errorf("unexpected arguments: %v", fs.Args())
	}
	if *failRank >= 0 {
		c.FailDPRank = failRank
	}
	if c.Port < 0 {
		return c, errors.New("--port is required")
	}
	c.Role = Role(*role)
	_, err := c.withDefaults()
	return c, err
}
