"""One rule for knobs: every setting is a launcher flag, and its environment
twin is `SLUICE_` + the flag's name (declared once, with clap's `env`).

These tests read the source tree for every `SLUICE_…` name (router/,
launcher/, server/, kernels/) and check each against `sluice-launcher
--help`, so that a variable read somewhere without a flag (a hidden switch)
fails here. The few names that are not settings have a reason each below.
"""

from __future__ import annotations

import re
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from conftest import find_executable

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("router", "launcher", "server", "kernels")
SUFFIXES = {".rs", ".py", ".cpp", ".h", ".hpp", ".c", ".cu", ".sh", ".toml"}
SKIPPED_PARTS = {"target", "__pycache__", "build", "dist", ".venv", "node_modules"}
NAME = re.compile(r"\bSLUICE_[A-Z0-9_]+\b")

# Names that are not settings of a deployment, and why.
NOT_SETTINGS = {
    # Fault injection for the fault tests (server/sluice_server/faults.py,
    # the router's hidden --fault); never set in production.
    "SLUICE_FAULT": "fault injection",
    # Where the launcher finds its two programs when they are not installed
    # beside it (launcher/src/exe.rs): development and the supervision tests.
    "SLUICE_SERVER_BIN": "program location override",
    "SLUICE_ROUTER_BIN": "program location override",
    # Which launcher the benchmark scripts start (server/sluice_bench/launch.py),
    # a setting of the benchmarks, not of the server.
    "SLUICE_LAUNCHER_BIN": "program location override",
    # A C preprocessor macro of the CPU kernels, not an environment variable.
    "SLUICE_X86": "C macro",
}

# Flags of `sluice-router` only: the launcher sets them itself for the router
# it starts (the shard socket it made, the model folder it resolved).
ROUTER_PLUMBING = {"SLUICE_MASTER_SHARD_UDS_PATH", "SLUICE_TOKENIZER"}

# Flags whose environment twin keeps the name another tool gives it
# (README, "Launcher flags"): TGI's PORT and API_KEY, OpenTelemetry's
# exporter variables, torch.distributed's rendezvous, huggingface_hub's cache.
STANDARD_NAMES = {
    "port": "PORT",
    "api-key": "API_KEY",
    "otlp-endpoint": "OTEL_EXPORTER_OTLP_ENDPOINT",
    "otlp-service-name": "OTEL_SERVICE_NAME",
    "master-addr": "MASTER_ADDR",
    "master-port": "MASTER_PORT",
    "huggingface-hub-cache": "HF_HUB_CACHE",
}

# Flags without an environment twin: actions, and the negations of flags
# that have one (--no-prefix-caching is SLUICE_PREFIX_CACHING=false).
NO_ENV = {"help", "version", "dry-run", "no-prefix-caching", "no-web-ui"}


def names_in_source() -> dict[str, list[str]]:
    """Every SLUICE_ name in the scanned folders: {name: [file, ...]}."""
    found: dict[str, list[str]] = {}
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*")):
            if path.suffix not in SUFFIXES or not path.is_file():
                continue
            if SKIPPED_PARTS.intersection(path.relative_to(ROOT).parts):
                continue
            for name in set(NAME.findall(path.read_text(errors="replace"))):
                found.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return found


def help_flags(program: str) -> dict[str, str | None]:
    """{long flag: its environment variable or None} from `PROGRAM --help`."""
    text = subprocess.run([find_executable(program), "--help"], capture_output=True, text=True,
                          check=True).stdout
    flags: dict[str, str | None] = {}
    heads: list[str] = []
    current = None
    for line in text.splitlines():
        head = re.match(r"^ {2,6}(?:-\w, )?--([a-z0-9-]+)", line)
        if head:
            current = head.group(1)
            heads.append(current)
            flags[current] = None
            continue
        env = re.search(r"\[env: ([A-Z0-9_]+)", line)
        if env and current:
            flags[current] = env.group(1)
    repeated = [flag for flag, count in Counter(heads).items() if count > 1]
    assert not repeated, f"{program} --help lists these flags more than once: {repeated}"
    assert "help" in flags, text
    return flags


@pytest.fixture(scope="module")
def launcher_envs() -> dict[str, str | None]:
    return help_flags("sluice-launcher")


def test_every_sluice_variable_read_has_a_flag(launcher_envs):
    router_envs = set(help_flags("sluice-router").values())
    documented = set(launcher_envs.values())
    hidden = {
        name: files for name, files in names_in_source().items()
        if name not in documented and name not in NOT_SETTINGS
        and not (name in ROUTER_PLUMBING and name in router_envs)
    }
    assert not hidden, (
        "SLUICE_ variables read without a launcher flag (declare a flag with clap's `env` in "
        f"launcher/src/args.rs or router/src/config.rs, or say why in NOT_SETTINGS): {hidden}")


def test_the_exceptions_are_still_there():
    """A name left in an allow-list after its use is gone hides the next one."""
    found = names_in_source()
    stale = [name for name in [*NOT_SETTINGS, *ROUTER_PLUMBING] if name not in found]
    assert not stale, f"not in the source any more, drop them from this test: {stale}"


def test_every_flag_has_one_sluice_twin(launcher_envs):
    wrong = {}
    for flag, env in launcher_envs.items():
        if flag in NO_ENV:
            continue
        expected = STANDARD_NAMES.get(flag, "SLUICE_" + flag.upper().replace("-", "_"))
        if env != expected:
            wrong[flag] = (env, expected)
    assert not wrong, f"flag: (its variable, the rule's name): {wrong}"
    twins = Counter(env for env in launcher_envs.values() if env)
    assert [env for env, count in twins.items() if count > 1] == []
