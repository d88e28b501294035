"""Dump the OpenAPI schema a real ``kvmesh head`` serves to a file (keys sorted).

The SDK's request types are generated from it (``npm run gen``). From the repository
root: ``python sdk/typescript/scripts/dump_openapi.py sdk/typescript/openapi.json``
starts a demo-tiny head on loopback for the purpose and stops it; ``--url URL`` reads
a running head's instead.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any


def fetch_schema(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url.rstrip("/") + "/openapi.json", timeout=30) as r:
        schema = json.load(r)
    if not isinstance(schema, dict) or "paths" not in schema:
        raise SystemExit(f"{url}/openapi.json is not an OpenAPI schema")
    return schema


def schema_of_a_new_head() -> dict[str, Any]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvmesh.cli",
            "head",
            "--model",
            "demo-tiny",
            "--listen",
            "127.0.0.1:0",
            "--no-publish",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        m = re.search(r"(https?://\S+) grpc", line)
        if not m:
            raise SystemExit(f"kvmesh head did not start: {line!r}")
        return fetch_schema(m.group(1))
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", default="openapi.json", type=Path)
    ap.add_argument("--url", help="a running head's URL (default: start one)")
    args = ap.parse_args()
    schema = fetch_schema(args.url) if args.url else schema_of_a_new_head()
    args.out.write_text(json.dumps(schema, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
