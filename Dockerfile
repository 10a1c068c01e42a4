# Static pdrouter image: build with CGO disabled, run from scratch-like distroless.
FROM golang:1.26-bookworm AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
RUN CGO_ENABLED=0 go build -trimpath -ldflags="-s -w" -o /out/pdrouter ./cmd/pdrouter

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/pdrouter /usr/local/bin/pdrouter
# 8000: API (sglang-router's default is 30000), 29000: Prometheus.
EXPOSE 8000 29000
USER nonroot:nonroot
ENTRYPOINT ["/usr/local/bin/pdrouter"]
CMD ["--host", "0.0.0.0", "--port", "8000"]
