package mockworker

import "context"

// KVTransfer is the seam through which a PD-role mock moves KV pages between
// the prefill and the decode side of one request. A nil KVTransfer in Config
// means no KV movement (the mock only records the bootstrap fields).
//
// Contract, per bootstrap entry of a request (one entry for scalar bootstrap
// fields, N for arrays of length N):
//   - a prefill-role mock calls Prefill after its prefill delay and before it
//     answers; the decode-role mock of the same request calls Decode before it
//     emits its first token and blocks on it.
//   - ctx is the HTTP request's context: it is cancelled when the client goes
//     away, and implementations must then return promptly.
//   - a non-nil error turns into a 500 for the whole request (a checksum
//     mismatch must be reported as an error, never as ChecksumOK=false alone),
//     or into the status of an error in its chain with an HTTPStatus() int
//     method (KV pool exhausted: 503).
//   - a non-nil result is reported in the response: meta_info.kv_transfer on
//     /generate, a top-level kv_transfer on the OpenAI routes (in the last SSE
//     chunk when streaming). nil means "nothing to report".
//
// Implementations must be safe for concurrent use.
type KVTransfer interface {
	Prefill(ctx context.Context, req KVRequest) (*KVResult, error)
	Decode(ctx context.Context, req KVRequest) (*KVResult, error)
}

// KVRequest identifies one transfer. Both sides see the same prompt, so the
// prefill side can derive page contents from Prompt and Room and the decode
// side can verify them independently.
type KVRequest struct {
	Room          uint64 // bootstrap_room
	BootstrapHost string // bootstrap_host
	BootstrapPort int    // bootstrap_port, or Config.BootstrapPort when it was null
	Prompt        []byte // the prompt text (input_ids as their JSON text); read-only
	PromptTokens  int
}

// KVResult is what a transfer reports back into the response body.
type KVResult struct {
	Bytes      int64   `json:"bytes"`
	Pages      int64   `json:"pages"`
	Transport  string  `json:"transport"`
	ChecksumOK bool    `json:"checksum_ok"`
	TransferMS float64 `json:"transfer_ms"`
}

// reportedKV moves nothing and reports a transfer of its ms
// (Config.ReportTransferMS).
type reportedKV float64

func (k reportedKV) Prefill(context.Context, KVRequest) (*KVResult, error) { return k.result(), nil }
func (k reportedKV) Decode(context.Context, KVRequest) (*KVResult, error)  { return k.result(), nil }

func (k reportedKV) result() *KVResult {
	return &KVResult{Transport: "none", ChecksumOK: true, TransferMS: float64(k)}
}
