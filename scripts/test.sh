#!/usr/bin/env bash
# Installs everything (scripts/install.sh --test) and runs every test:
# the Rust unit/property tests, the shard's Python tests, the kernel tests,
# the Helm chart's tests and the end-to-end tests against a real launcher.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --test
# promtool (Debian's prometheus package) checks the /metrics exposition in
# integration-tests/test_observability.py.
# chromium (Debian's) is the browser integration-tests/test_web_ui.py drives
# through Playwright (Playwright's own browser download cannot work offline).
missing=()
command -v promtool >/dev/null || missing+=(prometheus)
[ -x /usr/bin/chromium ] || missing+=(chromium)
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
fi
# helm for the chart tests (deploy/tests, integration-tests/test_pod_contract.py):
# built once from the Go module proxy, then cached in ~/.cache/sluice/tools.
SLUICE_HELM="$(bash scripts/install_helm.sh)"
export SLUICE_HELM
VENV="${SLUICE_VENV:-$PWD/.venv}"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
export PATH="$HOME/.cargo/bin:$PATH"

# The tests build in the release profile, so they reuse the dependencies that
# install.sh's maturin build just compiled (a debug build compiles all of them
# again: 13-20 minutes on a fresh 2-core machine). Only the two workspace
# crates are rebuilt, with debug assertions and overflow checks on, as in a
# debug build: the router's invariant checks (debug_assert!) still run.
echo "== cargo test (${SECONDS}s in)"
checks=()
for crate in sluice-router sluice-launcher; do
  checks+=(--config "profile.release.package.$crate.debug-assertions=true"
           --config "profile.release.package.$crate.overflow-checks=true")
done
cargo test --workspace --release --quiet "${checks[@]}"

# No module may import one that imports it back (router, launcher, shard).
echo "== import cycles (${SECONDS}s in)"
python scripts/check_import_cycles.py

# One pytest process per folder: each folder has its own conftest.py, and
# tests import helpers from it by that module name. -rs prints every skip
# with its reason.
for suite in server/tests kernels/tests server/bench_tests deploy/tests integration-tests; do
  echo "== pytest $suite (${SECONDS}s in)"
  python -m pytest -q -rs -p no:cacheprovider "$suite"
done
echo "== all tests passed in ${SECONDS}s"
