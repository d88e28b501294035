"""``kvmesh store``: look into a disk tier directory.

``kvmesh store stats DIR`` reads headers only and changes nothing. ``kvmesh store
verify DIR`` checks every file's digest (BLAKE3 or SHA-256, as its card says)
against its name, reports bad files (and blocks whose parent file is missing),
and with ``--delete`` removes them;
it exits 1 when anything bad is left. Run it on a directory no node is using.

The ``--disk*`` options themselves are declared in :mod:`kvmesh.mesh.options`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import click

from ..errors import MalformedPayload
from ..store import DiskFiles, DiskRecord, unlink


def _files(directory: str) -> DiskFiles:
    if not (Path(directory) / "blocks").is_dir():
        raise click.UsageError(f"{directory} is not a kvmesh disk tier (no blocks/ inside)")
    return DiskFiles(directory)


def _scan(files: DiskFiles) -> tuple[list[DiskRecord], list[tuple[str, str]]]:
    bad: list[tuple[str, str]] = []
    records = list(files.scan(lambda path, why: bad.append((path, why))))
    return records, bad


@click.group()
def store() -> None:
    """Inspect and check a disk tier directory (``--disk DIR``)."""


@store.command()
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="One JSON object.")
def stats(directory: str, as_json: bool) -> None:
    """Blocks, bytes and namespaces in DIR, from headers only (changes nothing)."""
    files = _files(directory)
    records, bad = _scan(files)
    per_ns: dict[str, list[int]] = {}
    for r in records:
        n = per_ns.setdefault(r.header.namespace.hex(), [0, 0])
        n[0] += 1
        n[1] += r.nbytes
    out = {
        "directory": str(Path(directory).resolve()),
        "blocks": len(records),
        "bytes": sum(r.nbytes for r in records),
        "tails": sum(r.header.kind == "tail" for r in records),
        "bad_headers": len(bad),
        "temp_files": len(os.listdir(files.tmp)),
        "namespaces": {ns: {"blocks": c, "bytes": b} for ns, (c, b) in per_ns.items()},
    }
    if as_json:
        click.echo(json.dumps(out, indent=2))
        return
    total = sum(r.nbytes for r in records)
    click.echo(f"{out['directory']}: {len(records)} blocks, {total / 2**20:.1f} MiB")
    click.echo(f"  tails {out['tails']}, bad headers {len(bad)}, temp files {out['temp_files']}")
    for ns, (c, b) in sorted(per_ns.items()):
        click.echo(f"  namespace {ns[:16]}: {c} blocks, {b / 2**20:.1f} MiB")


@store.command()
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@click.option("--delete", is_flag=True, help="Delete bad, orphaned and temp files.")
def verify(directory: str, delete: bool) -> None:
    """Check every file's digest in DIR; report (and with --delete remove) bad ones."""
    files = _files(directory)
    records, bad = _scan(files)
    good: set[bytes] = set()
    for r in sorted(records, key=lambda r: r.header.start):  # parents first
        try:
            files.open(r.header, r.digest, r.nbytes)
        except (MalformedPayload, OSError) as e:
            bad.append((str(files.path(r.digest)), str(e)))
            continue
        h = r.header
        if not (h.start == 0 and h.parent == h.namespace) and h.parent not in good:
            bad.append((str(files.path(r.digest)), "orphan: parent block missing or bad"))
            continue
        good.add(h.key)
    temp = [str(files.tmp / n) for n in os.listdir(files.tmp)]
    for path, why in bad:
        click.echo(f"bad {path}: {why}")
        if delete:
            unlink(path)
    for path in temp:
        click.echo(f"temp {path}: an interrupted write")
        if delete:
            unlink(path)
    verb = "deleted" if delete else "found"
    click.echo(f"{len(good)} good, {len(bad)} bad and {len(temp)} temp file(s) {verb}")
    if (bad or temp) and not delete:
        raise SystemExit(1)


if __name__ == "__main__":
    store()
