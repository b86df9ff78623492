#!/usr/bin/env bash
# Installs everything (scripts/install.sh --test) and runs every test:
# the Rust unit/property tests, the shard's Python tests, the kernel tests
# and the end-to-end tests against a real launcher.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --test
VENV="${SLUICE_VENV:-$PWD/.venv}"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
export PATH="$HOME/.cargo/bin:$PATH"

echo "== cargo test"
cargo test --workspace --quiet

echo "== pytest"
python -m pytest -q -p no:cacheprovider server/tests kernels integration-tests
