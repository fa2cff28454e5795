# flashsale: the order service and the load test, for docker-compose.yml.
#
# Dependencies are cached with cargo-chef rather than BuildKit cache mounts: its
# cached dependencies are ordinary image layers, so they work with any builder and
# survive in a CI registry cache, where a cache mount starts empty.
FROM rust:1-bookworm AS chef
# protoc: the etcd client crate generates its gRPC code at build time, and imports
# protoc's own .proto files (libprotobuf-dev, which protoc only recommends).
RUN apt-get update && apt-get install -y --no-install-recommends protobuf-compiler libprotobuf-dev \
    && rm -rf /var/lib/apt/lists/*
RUN cargo install cargo-chef --locked --version 0.1.73
WORKDIR /src

# The recipe: manifests and Cargo.lock only, so it changes only when dependencies do.
FROM chef AS planner
COPY . .
RUN cargo chef prepare --recipe-path recipe.json

FROM chef AS build
COPY --from=planner /src/recipe.json recipe.json
# The dependency layer: rebuilt only when the recipe changes, not on source edits.
RUN cargo chef cook --release --workspace --recipe-path recipe.json
COPY . .
RUN cargo build --release --locked --workspace \
    && cp target/release/flashsale target/release/loadtest /usr/local/bin/

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --user-group --home-dir /app --create-home flashsale
COPY --from=build /usr/local/bin/flashsale /usr/local/bin/loadtest /usr/local/bin/
# The dashboard is compiled into the binary: nothing else to copy.
WORKDIR /app
# Not root: the Kubernetes manifests run it as 10001 too.
USER 10001:10001
EXPOSE 8080
# The binary asks its own /readyz: the image carries no curl.
HEALTHCHECK --interval=5s --timeout=3s --retries=12 CMD ["flashsale", "healthcheck"]
CMD ["flashsale", "serve", "--bind", "0.0.0.0", "--port", "8080"]
