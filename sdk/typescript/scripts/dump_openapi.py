"""Dump the OpenAPI schema a real ``kvmesh head`` serves (demo-tiny model) to a file.

The SDK's request types are generated from it (``npm run gen``). Usage, from the
repository root: ``python sdk/typescript/scripts/dump_openapi.py sdk/typescript/openapi.json``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path


def dump(out: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvmesh.cli", "head", "--model", "demo-tiny", "--listen",
         "127.0.0.1:0", "--no-publish"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        m = re.search(r"(https?://\S+) grpc", line)
        if not m:
            raise SystemExit(f"kvmesh head did not start: {line!r}")
        with urllib.request.urlopen(m.group(1) + "/openapi.json", timeout=30) as r:
            schema = json.load(r)
        out.write_text(json.dumps(schema, indent=2, sort_keys=True) + "\n")
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    dump(Path(sys.argv[1] if len(sys.argv) > 1 else "openapi.json"))
