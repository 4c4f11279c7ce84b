# syntax=docker/dockerfile:1
#
# batchgate: a KServe v2 gRPC inference gateway for PyTorch models, on a CUDA GPU.
#
#   docker build -t batchgate .
#   docker run --gpus all -p 8001:8001 -p 8002:8002 batchgate
#   docker run --gpus all -p 8001:8001 -v /path/to/repo:/models:ro batchgate   # your own models
#   docker stop -t 40 <container>      # > --drain-timeout-s (30 s): SIGTERM drains, then exits 0
#
# The example models from models/ are baked in at /models (BATCHGATE_MODEL_REPOSITORY=/models);
# mount your own Triton-layout repository over /models, or pass `--model-repository PATH`.
# Without a GPU the same image serves on the CPU (KIND_AUTO models fall back to it).
#
# Base image and torch, one pinned combination:
# - torch is pinned by constraints.txt (torch==2.13.0), the pin every other install uses. On PyPI
#   the Linux x86_64 wheel of torch 2.13.0 IS the CUDA build: CUDA 13.0 (nvidia-cuda-runtime
#   13.0.x, cuBLAS 13.1) with cuDNN 9.20 and NCCL, all as nvidia-* wheels that torch loads from
#   site-packages. So the image needs no second registry (PyTorch's own index serves the same
#   cu130 build) and no CUDA libraries from the base image.
# - Base: nvidia/cuda:13.0.2-base-ubuntu24.04, the same CUDA 13.0 line. Its "base" flavour has
#   only the CUDA runtime and the NVIDIA Container Toolkit settings (NVIDIA_VISIBLE_DEVICES,
#   NVIDIA_DRIVER_CAPABILITIES=compute,utility for libcuda and NVML, NVIDIA_REQUIRE_CUDA, which
#   refuses to start on a host driver too old for CUDA 13.0, i.e. older than 580). The
#   "runtime"/"cudnn-runtime" flavours would add several GB more of cuBLAS/cuDNN that torch's
#   wheels already bring, at versions torch does not use. Ubuntu 24.04 brings Python 3.12
#   (batchgate needs >= 3.10; torch 2.13.0 ships cp312 manylinux_2_28 wheels, glibc 2.39 here).
# - For reproducible releases, pin the base by digest too: --build-arg CUDA_IMAGE=...@sha256:...
ARG CUDA_IMAGE=nvidia/cuda:13.0.2-base-ubuntu24.04

# ---------------------------------------------------------------------------------------------
# Builder: a virtual environment at /opt/venv with torch (CUDA) and batchgate[gpu].
FROM ${CUDA_IMAGE} AS builder

ARG DEBIAN_FRONTEND=noninteractive
# Ubuntu's python3.12 is not pinned to an exact version: noble-updates keeps only the newest
# security build, so a pinned version stops installing as soon as the next fix lands.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.12 python3.12-venv \
    && rm -rf /var/lib/apt/lists/*

RUN python3.12 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1

WORKDIR /src
# torch first, in its own layer: it is GBs and changes only with constraints.txt. The version is
# written here too so that hadolint sees a pin; pip fails the build if it ever disagrees with
# constraints.txt (tests/test_dockerfile.py checks that they agree).
COPY constraints.txt ./
RUN pip install --no-cache-dir -c constraints.txt "torch==2.13.0" \
    && python -c "import torch, sys; v = torch.version.cuda; sys.exit(0 if v and v.startswith('13.') else f'torch {torch.__version__} is not the CUDA 13 build (cuda={v})')"

# Then batchgate itself, from the source tree (not editable), with the extras `server` (the
# server's dependencies) and `gpu` (nvidia-ml-py: GPU busy % and memory figures through NVML).
COPY pyproject.toml setup.py README.md ./
COPY batchgate/ batchgate/
COPY protos/ protos/
COPY server/ server/
COPY batcher/ batcher/
COPY clients/ clients/
COPY bench/ bench/
COPY models/ models/
RUN pip install --no-cache-dir -c constraints.txt ".[server,gpu]" \
    && batchgate serve --help > /dev/null \
    && python -I -c "import batchgate.server.frontend.app, grpc_health.v1.health_pb2" \
    && python server/native/describe_health.py /src/health.binpb \
    && python server/native/generate_rules.py /src/rules.h

# ---------------------------------------------------------------------------------------------
# The native front end (server/native): C++ on Ubuntu 24.04's gRPC C++ 1.51 and protobuf 3.21,
# the versions scripts/build-native.sh builds against on Debian 12. Only the binary leaves this
# stage; the runtime stage installs the shared libraries it links (libgrpc++1.51t64 pulls in
# gRPC core, protobuf, abseil, c-ares, re2).
FROM ${CUDA_IMAGE} AS native

ARG DEBIAN_FRONTEND=noninteractive
# Not pinned to exact versions, for the reason given in the builder stage.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends cmake make g++ pkg-config protobuf-compiler \
       protobuf-compiler-grpc libprotobuf-dev libgrpc++-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /src
# The protocols are generated at build time from the repository's own .proto files.
COPY protos/inference.proto protos/model_config.proto protos/wire.proto protos/handover.proto \
     protos/
COPY server/native/ server/native/
# grpc.health.v1's descriptor, from the Python stage's grpcio-health-checking: reflection
# describes the health service with it. rules.h, the rules' C++ copy, from the Python modules
# that define them (server/native/generate_rules.py), written there too.
COPY --from=builder /src/health.binpb /src/rules.h /src/
RUN cmake -S server/native -B /build -DCMAKE_BUILD_TYPE=Release -DBATCHGATE_WERROR=ON \
          -DBATCHGATE_HEALTH_DESCRIPTOR=/src/health.binpb -DBATCHGATE_RULES_HEADER=/src/rules.h \
    && cmake --build /build --parallel "$(nproc)" --target batchgate-frontend \
    && install -D -m 0755 /build/batchgate-frontend /opt/batchgate/bin/batchgate-frontend

# ---------------------------------------------------------------------------------------------
# Runtime: the same base, Python, the venv, the native front end, the example models; runs as
# a non-root user.
FROM ${CUDA_IMAGE} AS runtime

ARG CUDA_IMAGE
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG CREATED=unknown
LABEL org.opencontainers.image.title="batchgate" \
      org.opencontainers.image.description="KServe v2 / Open Inference Protocol gRPC gateway that batches requests for PyTorch models" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="${CUDA_IMAGE}"

ARG DEBIAN_FRONTEND=noninteractive
# The interpreter the venv's python links to (/usr/bin/python3.12); no venv module, no pip;
# the native front end's shared libraries.
# Not pinned to an exact version, for the reason given in the builder stage.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.12 libgrpc++1.51t64 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 batchgate \
    && useradd --system --uid 10001 --gid 10001 --home-dir /home/batchgate --create-home \
       --shell /usr/sbin/nologin batchgate

COPY --from=builder /opt/venv /opt/venv
COPY --from=native /opt/batchgate/bin/batchgate-frontend /opt/batchgate/bin/batchgate-frontend
# Owned by root, readable by all: the server only reads its repository. Mount yours over it.
COPY models/ /models/

# BATCHGATE_NATIVE_FRONTEND: where `--frontend auto` (the default) finds the native front end.
ENV PATH=/opt/venv/bin:$PATH \
    BATCHGATE_NATIVE_FRONTEND=/opt/batchgate/bin/batchgate-frontend \
    BATCHGATE_MODEL_REPOSITORY=/models \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1

WORKDIR /home/batchgate
# Numeric, so that Kubernetes' runAsNonRoot can check it.
USER 10001:10001

# gRPC (KServe v2, health, reflection) and Prometheus /metrics.
EXPOSE 8001 8002

# batchgate drains on SIGTERM: health turns NOT_SERVING, new requests get UNAVAILABLE, queued and
# running ones finish within --drain-timeout-s (30 s), then it exits 0. Give `docker stop -t` /
# Kubernetes' terminationGracePeriodSeconds more than that (Docker's default is only 10 s).
STOPSIGNAL SIGTERM

# Healthy only while grpc.health.v1 answers SERVING for the whole server (service ""): after
# every model has loaded and warmed up, and until a drain starts. Plain Python with
# grpcio-health-checking from the venv; no probe binary to download. To move the
# port, set BATCHGATE_GRPC_PORT: the server and this check both read it.
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["/opt/venv/bin/python", "-c", "import os, sys, grpc; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; ch = grpc.insecure_channel('127.0.0.1:' + os.environ.get('BATCHGATE_GRPC_PORT', '8001')); r = g.HealthStub(ch).Check(h.HealthCheckRequest(service=''), timeout=3); sys.exit(0 if r.status == h.HealthCheckResponse.SERVING else 1)"]

ENTRYPOINT ["batchgate"]
CMD ["serve", "--host", "0.0.0.0"]
