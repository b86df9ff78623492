"""Generates the Python gRPC stubs from proto/ into the server package.

Run before building a wheel so the stubs ship inside it; a source checkout
also generates them on first import (sluice_server/pb/__init__.py).
"""

import sys
from pathlib import Path

root = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(root / "server"))

from sluice_server.pb import generate  # noqa: E402  (generates on import when stale)

generate()
