# pdrouter: `make run` starts a local PD deployment on :8000, `make test` runs every test.
GO      ?= go
BIN     := bin
GOFLAGS ?=

.PHONY: build test run bench bench-vllm bench-ucx bench-kv deps clean fuzz test-kv-sglang bench-kv-sglang cuda-bundle bench-kv-gpu bench-nixl-gpu devbench-bundle chaos soak

build:
	CGO_ENABLED=0 $(GO) build $(GOFLAGS) -o $(BIN)/pdrouter ./cmd/pdrouter
	CGO_ENABLED=0 $(GO) build $(GOFLAGS) -o $(BIN)/mockworker ./cmd/mockworker
	CGO_ENABLED=0 $(GO) build $(GOFLAGS) -o $(BIN)/pdbench ./cmd/pdbench
	$(GO) build $(GOFLAGS) -o $(BIN)/kvproxy ./cmd/kvproxy

# deps installs what the tests need (UCX from Debian) when it is missing.
deps:
	@scripts/install-deps.sh test

# The race detector changes allocations and stack sizes: the tests that count
# them (router/*_norace_test.go) run without it, in a pass of their own.
NORACE_TESTS = $(shell grep -ho '^func Test[A-Za-z0-9_]*' router/*_norace_test.go | sed 's/^func //' | paste -sd'|')

test: deps
	$(GO) vet ./...
	CGO_ENABLED=0 $(GO) build ./cmd/pdrouter
	$(GO) test -race -count=1 -timeout 12m ./...
	$(GO) test -count=1 -run '^($(NORACE_TESTS))$$' ./router/
	cd deploy/helm && $(GO) vet ./... && $(GO) test -count=1 ./...
	@scripts/test-kv-sglang.sh

# fuzz: each Fuzz target for FUZZTIME (make test runs their seed corpora).
FUZZTIME ?= 15s
fuzz:
	@for d in $$(grep -rl --include='*_test.go' '^func Fuzz' . | xargs -n1 dirname | sort -u); do \
		for f in $$(grep -ho '^func Fuzz[A-Za-z0-9_]*' $$d/*_test.go | sed 's/^func //'); do \
			$(GO) test -run '^$$' -fuzz "^$$f$$" -fuzztime $(FUZZTIME) $$d || exit 1; \
		done; \
	done

# chaos: issue 13's attacks (fd exhaustion, slowloris, invented methods, HELLO
# flood) against the real binaries at full size; `make test` runs a short pass.
chaos: deps
	CHAOS_FULL=1 $(GO) test -count=1 -v -timeout 10m ./testkit/chaos

# soak: MINUTES of mixed streaming/non-streaming PD load through the real
# binaries; fails if router or kvproxy RSS, goroutines or fds grow after the
# warm-up (bounds in testkit/soak). `make test` runs a 20 s pass.
MINUTES ?= 10
soak: deps
	SOAK_MINUTES=$(MINUTES) $(GO) test -count=1 -v -run TestSoak -timeout $$(( $(MINUTES) + 5 ))m ./testkit/soak

# SGLang 0.5.23's own PD code moving KV through kvproxy (and through Mooncake's
# engine); the first run installs a cached venv (~6 GB, a few minutes).
test-kv-sglang: deps
	@scripts/test-kv-sglang.sh

bench-kv-sglang: deps
	@scripts/bench-kv-sglang.sh

run: deps build
	@scripts/run-local.sh

# bench installs nginx and wrk (and UCX, which kvproxy's build needs) first.
bench:
	@scripts/install-deps.sh bench
	@$(MAKE) --no-print-directory build
	CGO_ENABLED=0 $(GO) build $(GOFLAGS) -o $(BIN)/fastproxy ./bench/fastproxy
	CGO_ENABLED=0 $(GO) build $(GOFLAGS) -o $(BIN)/evproxy ./bench/evproxy
	CGO_ENABLED=0 $(GO) build $(GOFLAGS) -o $(BIN)/stubengine ./bench/stubengine
	@scripts/bench-router.sh
	@scripts/bench-vllm.sh

# bench-vllm: pdrouter --vllm-pd-disaggregation against vllm-router 0.1.17 (pip) on mock vLLM
# engines and stubengine's; nginx for the TTFT hop it is held against.
bench-vllm: build
	@scripts/install-deps.sh bench
	CGO_ENABLED=0 $(GO) build $(GOFLAGS) -o $(BIN)/stubengine ./bench/stubengine
	@scripts/bench-vllm.sh

bench-ucx: deps
	@scripts/bench-ucx.sh

bench-kv: deps build
	@scripts/bench-kv.sh

# cuda-bundle builds kvproxy and ucxbench against UCX 1.22 with CUDA (PyPI's
# libucx-cu13 wheel) into bin/cuda, with the libraries they run with.
cuda-bundle:
	@scripts/cuda-bundle.sh

# bench-kv-gpu builds the bundle; the benchmark itself runs on a GPU machine:
# scripts/bench-kv-gpu.sh there (results in $$OUT or bench/out/kv-gpu.json).
bench-kv-gpu: cuda-bundle
	@echo "bundle ready: run scripts/bench-kv-gpu.sh on the GPU machine with bin/cuda carried"

# bench-nixl-gpu builds kvproxy with CUDA and a trimmed NIXL 1.5.1 (bin/nixl);
# on the GPU machine run scripts/bench-nixl-gpu.sh carrying
# bin/cuda/bin/kvproxy, bin/cuda/lib and bin/nixl.
bench-nixl-gpu: cuda-bundle
	@scripts/nixl-bundle.sh
	@echo "bundles ready: run scripts/bench-nixl-gpu.sh on the GPU machine with bin/cuda/bin/kvproxy, bin/cuda/lib and bin/nixl carried"

# devbench-bundle builds bin/devbench: what scripts/devbench-run.sh needs to run bench-vllm on
# the 16-core GPU machine (no Go, nginx or package index there), each router pinned to one core.
devbench-bundle:
	@scripts/devbench-bundle.sh
	@echo "bundle ready: run scripts/devbench-run.sh on the GPU machine with bin/devbench carried"

clean:
	rm -rf $(BIN) bench/out
