"""Chart tests: helm lint / template on every values profile, no cluster."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


def launcher_exe() -> str:
    env = os.environ.get("SLUICE_LAUNCHER_BIN")
    if env:
        return env
    here = Path(sys.executable).parent / "sluice-launcher"
    if here.exists():
        return str(here)
    found = shutil.which("sluice-launcher")
    if not found:
        pytest.fail("sluice-launcher is not installed: run `bash scripts/install.sh --test`")
    return found


@pytest.fixture(scope="session")
def launcher_help() -> dict[str, dict]:
    """Every long flag of `sluice-launcher --help`: {name: {"env", "takes_value", "possible"}}."""
    text = subprocess.run([launcher_exe(), "--help"], capture_output=True, text=True, check=True).stdout
    flags: dict[str, dict] = {}
    current = None
    for line in text.splitlines():
        head = re.match(r"^\s+(?:-\w, )?--([a-z0-9-]+)(.*)$", line)
        if head:
            current = head.group(1)
            flags[current] = {"takes_value": "<" in head.group(2), "env": None, "possible": None, "help": ""}
            continue
        if current:
            flags[current]["help"] += line
            env = re.search(r"\[env: ([A-Z0-9_]+)=?", line)
            if env:
                flags[current]["env"] = env.group(1)
            possible = re.search(r"\[possible values: ([^\]]+)\]", line)
            if possible:
                flags[current]["possible"] = [v.strip() for v in possible.group(1).split(",")]
    assert "model-id" in flags and "help" in flags, text
    return flags
