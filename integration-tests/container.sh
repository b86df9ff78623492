#!/usr/bin/env bash
# Builds the Dockerfile with buildah (no Docker engine needed) against local
# Debian base images, runs the image, and checks a chat completion end to end.
# Not part of CI: a cold build downloads torch into the image and compiles the
# Rust workspace, which takes a long time on 2 cores.
#
#   sudo bash integration-tests/container.sh
set -euo pipefail
cd "$(dirname "$0")/.."
WORK="${CONTAINER_WORK:-/var/tmp/sluice-container}"
PORT="${PORT:-18080}"
mkdir -p "$WORK"

command -v buildah >/dev/null || { apt-get update && apt-get install -y buildah podman debootstrap; }

# 1. A Debian base image made from Debian's own packages.
if ! buildah images --quiet localhost/debian:bookworm-slim >/dev/null 2>&1; then
  rm -rf "$WORK/rootfs"
  debootstrap --variant=minbase bookworm "$WORK/rootfs"
  tar -C "$WORK/rootfs" -c . | podman import - localhost/debian:bookworm-slim
fi

# 2. A builder image: that base plus this machine's Rust toolchain (Debian's
#    rustc is too old for current crates, and no toolchain can be downloaded).
if ! buildah images --quiet localhost/sluice-rust-builder >/dev/null 2>&1; then
  ctr=$(buildah from localhost/debian:bookworm-slim)
  buildah run --isolation chroot "$ctr" -- sh -c \
    'apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev ca-certificates && rm -rf /var/lib/apt/lists/*'
  buildah copy "$ctr" "$HOME/.rustup" /root/.rustup
  buildah copy "$ctr" "$HOME/.cargo/bin" /root/.cargo/bin
  buildah config --env RUSTUP_HOME=/root/.rustup --env PATH=/root/.cargo/bin:/usr/local/bin:/usr/bin:/bin "$ctr"
  buildah commit "$ctr" localhost/sluice-rust-builder
  buildah rm "$ctr"
fi

# 3. The project's real Dockerfile. Its RUN steps use the host's network; where
#    the host reaches the registries through a TLS-intercepting proxy, they
#    also need the host's CA bundle: it is bind-mounted into every RUN step
#    (not into the image) and named to pip and cargo by mounted config files.
HOST_CA="${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}"
printf '[global]\ncert = /etc/sluice-host-ca.crt\n' > "$WORK/pip.conf"
printf '[http]\ncainfo = "/etc/sluice-host-ca.crt"\n' > "$WORK/cargo-config.toml"
start=$(date +%s)
buildah bud --isolation chroot \
  --volume "$HOST_CA:/etc/sluice-host-ca.crt:ro" \
  --volume "$WORK/pip.conf:/etc/pip.conf:ro" \
  --volume "$WORK/cargo-config.toml:/root/.cargo/config.toml:ro" \
  --build-arg BASE_IMAGE=localhost/debian:bookworm-slim \
  --build-arg BUILDER_IMAGE=localhost/sluice-rust-builder \
  -t sluice:test .
echo "image built in $(( $(date +%s) - start ))s"

# 4. Run it and ask for a completion.
ctr=$(buildah from sluice:test)
trap 'kill $run_pid 2>/dev/null || true; wait $run_pid 2>/dev/null || true; buildah rm "$ctr" >/dev/null' EXIT
buildah run --isolation chroot "$ctr" -- sluice-launcher --port "$PORT" --hostname 127.0.0.1 &
run_pid=$!
for _ in $(seq 600); do
  curl -sf "http://127.0.0.1:$PORT/ready" >/dev/null && break
  sleep 1
done
curl -sf "http://127.0.0.1:$PORT/v1/chat/completions" -H 'content-type: application/json' \
  -d '{"model": "SmolLM2-135M-Instruct.Q4_1", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 16}'
echo
echo "container OK"
