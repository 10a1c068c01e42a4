// Package mockworker is a mock SGLang engine for the router's end-to-end
// tests and benchmarks. It speaks SGLang's HTTP API in SGLang's shapes, plays
// the regular, prefill or decode role, fails or stalls on demand, and records
// what it received. cmd/mockworker wraps it; tests can run it in-process with
// Start(Config{...}).
//
// # Flags (Config fields)
//
//	--role prefill|decode|regular  Role (default regular); vllm-prefill|vllm-decode
//	                               play vLLM with a KV connector (vllm.go)
//	--vllm-kv-timeout D            vllm-prefill: KV kept for its decode this long (480s)
//	--host, --port                 Host (127.0.0.1), Port (required; 0 = ephemeral).
//	                               The first stdout line is "listening on HOST:PORT".
//	--worker-id                    WorkerID (default worker-PORT)
//	--model                        Model, the served model name (default mock)
//	--api-key, --require-api-key   401 without "Authorization: Bearer KEY" (any key
//	                               with --require-api-key alone); /health,
//	                               /health_generate, /metrics and /_mock/* stay public
//	--tokens N                     completion tokens (default 16); max_tokens,
//	                               max_completion_tokens, sampling_params.max_new_tokens
//	                               and max_output_tokens lower it
//	--token-delay D                between two tokens (streaming and not)
//	--prefill-delay D              before the first byte of a generation response
//	--status-code N                every generation request answers N with
//	                               {"object":"error","message","type","param","code"}
//	--fail-first-n N               the first N generation requests answer 500
//	--random-fail-rate P           500 with probability P (--seed makes it repeatable)
//	--crash-on-request             exit(1) on the first generation request
//	--hang                         never answer a generation request; it ends when
//	                               the client goes away (counted as client_gone)
//	--health-fail-after D          /health and /health_generate answer 503 after D
//	--health-flap D                they alternate 200 and 503 every D
//	--bootstrap-port N             port assumed for "bootstrap_port": null (8998)
//	--record-requests N            requests kept by /_mock/requests (1000; <0 none)
//	--no-v1-loads                  GET /v1/loads answers 404 (only /get_load)
//	--report-transfer-ms MS        report a KV transfer of MS ms (kv_transfer.transfer_ms,
//	                               prefill and decode) without a KV engine
//	--page-size, --cache-dtype (kv_cache_dtype), --tp-size, --dp-size, --transfer-backend
//	                               what /server_info reports (1, auto, 1, 1, mooncake);
//	                               --dp-size N is also the DP ranks requests may name
//	--no-server-info               GET /server_info answers 404 (/get_server_info only)
//	--no-dp-size                   dp_size left out of both info replies
//	--fail-dp-rank N               requests run on DP rank N answer 500 (-1: none)
//	--enable-http2                 serve h2c beside HTTP/1.1 on the port (prior
//	                               knowledge); /server_info reports enable_http2
//	--tls-cert F --tls-key F       serve HTTPS (URL() is then https://)
//	--tls-client-ca F              and require client certificates signed by F (mTLS)
//
// A generation request goes: auth (401) → crash → hang → malformed body (400)
// → PD bootstrap check (400) → prefill delay → injected failures → KV → tokens.
//
// DP ranks (dp.go): routed_dp_rank, else the deprecated data_parallel_rank,
// picks the rank a request runs on (400 unless an integer in [0, dp_size),
// as SGLang); none runs on rank 0. disagg_prefill_dp_rank (decode: the
// prefill rank holding the KV) must be a non-negative integer. All three
// are recorded as received, with the rank run (RecordedRequest.DPRank), and
// counted per rank (Stats.RankRequests); the load endpoints report per rank.
//
// # Endpoints
//
// Generation ("model work") routes, all recorded and subject to the knobs,
// all answering X-Worker-Id, with worker_id in JSON bodies and chunks:
//
//	POST /generate             text | [text] | input_ids | [[ids]]; sampling_params
//	                           (object or per-element list); stream; return_logprob.
//	                           meta_info: id, finish_reason {"type":"length","length"},
//	                           prompt_tokens, completion_tokens, cached_tokens,
//	                           e2e_latency, input/output_token_logprobs
//	                           [[logprob, id, null], ...], kv_transfer. A batch answers
//	                           a JSON array; a batch stream tags chunks with "index".
//	                           Streams carry the cumulative text, then data: [DONE].
//	POST /v1/chat/completions  OpenAI shapes; n; logprobs/top_logprobs; streams: a
//	                           role chunk, one delta per token, a finish chunk, a
//	                           usage chunk with stream_options.include_usage, [DONE]
//	POST /v1/completions       prompt string | [string] | [ids] | [[ids]]; logprobs N
//	POST /v1/embeddings, /v1/classify, /v1/rerank, /rerank, /v1/responses
//
// Output text is " tokN tokM ..." derived from the prompt: the same prompt gives
// the same text on every worker and role. A prompt's tokens are its
// whitespace-separated words (chat: over all message contents), or its ids.
//
// Info routes: GET /v1/models, /get_model_info, /model_info, /get_server_info,
// /server_info (disaggregation_mode is the role or "null"), /get_load
// ([{"dp_rank":0,"num_reqs","num_waiting_reqs":0,"num_tokens"}, ...] one
// entry per DP rank, from requests in flight), /v1/loads (SGLang's newer
// shape: {"loads":[{"dp_rank":0,"num_used_tokens","num_total_tokens",...},
// ...],"aggregate"}; dp_rank= selects a rank (400 outside dp_size) and
// include= is checked), /health, /health_generate, /metrics (sglang:* series),
// GET|POST /flush_cache.
//
// # PD roles
//
// In the prefill and decode roles /generate, /v1/chat/completions and
// /v1/completions need bootstrap_host and bootstrap_room (400 otherwise).
// Scalars apply to the whole request; arrays must have one element per batch
// element (/generate), per choice (chat n) or per prompt (completions).
// The prefill role answers one token (a stream is one chunk then [DONE]) and,
// with return_logprob, input_token_logprobs for the whole prompt. The decode
// role emits all tokens and reports only the last prompt token in
// input_token_logprobs, so a router's prefill++decode merge is visible.
// With Config.KV set, see KVTransfer.
//
// # Introspection
//
//	GET  /_mock/requests  the last generation requests, oldest first (RecordedRequest)
//	GET  /_mock/stats     {"requests","in_flight","client_gone","completed","errors",
//	                      "rank_requests":[per DP rank]} (Stats)
//	GET  /_mock/aborts    the POST /abort_request calls received (RecordedAbort)
//	POST /_mock/reset     clears them all (in_flight stays live)
//
// In-process: Server.Requests, Server.Stats, Server.Aborts, Server.Reset. A request is
// client_gone when its client disconnected before the response finished
// (during a delay, a hang, a KV wait or while streaming).
package mockworker
