# flashsale: the order service and the load test, for docker-compose.yml.
FROM rust:1-bookworm AS build
# protoc: the etcd client crate generates its gRPC code at build time.
RUN apt-get update && apt-get install -y --no-install-recommends protobuf-compiler \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cargo build --release --locked --workspace \
    && cp target/release/flashsale target/release/loadtest /usr/local/bin/

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates curl \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /usr/local/bin/flashsale /usr/local/bin/loadtest /usr/local/bin/
COPY static /app/static
WORKDIR /app
ENV FLASHSALE_STATIC_DIR=/app/static
EXPOSE 8080
CMD ["flashsale", "serve", "--bind", "0.0.0.0", "--port", "8080"]
