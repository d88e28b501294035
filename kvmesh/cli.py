"""The ``kvmesh`` command."""

from __future__ import annotations

import json
import sys

import click

from .engine import ENGINES
from .errors import KVMeshError


def _console():  # type: ignore[no-untyped-def]
    from rich.console import Console

    return Console(stderr=True)


class _Group(click.Group):
    """Turns expected failures into one clear line and exit status 2, not a traceback."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except (FileNotFoundError, ValueError, KVMeshError, NotImplementedError) as e:
            raise click.ClickException(str(e)) from None


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvmesh")
def main() -> None:
    """kvmesh: a peer-to-peer prefill KV cache network for LLM inference.

    Run `kvmesh demo` for the two-node evidence on the embedded demo model,
    `kvmesh peer` for a cache node, `kvmesh head` for an inference head.
    """


@main.command()
@click.option(
    "--local", is_flag=True, help="Single process: cold prefill vs. import from a local store."
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON line instead of a table.")
@click.option(
    "--model", default="demo", show_default=True, help="demo, demo-tiny or a local model directory."
)
@click.option("--engine", type=click.Choice(ENGINES), default="torch", show_default=True)
@click.option("--prompt-tokens", default=1000, show_default=True, help="Approximate prompt length.")
def demo(local: bool, as_json: bool, model: str, engine: str, prompt_tokens: int) -> None:
    """Show a prefix imported instead of recomputed, with identical output."""
    console = _console()
    if not local:
        from .runtime.demo import run_two_node

        run_two_node(model=model, engine=engine, prompt_tokens=prompt_tokens, as_json=as_json)
        return
    from .demo import as_dict, run_local
    from .engine import load_engine

    with console.status("loading model") as status:

        def progress(msg: str) -> None:
            status.update(msg)

        eng = load_engine(model, engine, progress=progress)
        progress(f"loaded {eng.card.summary()}")
        result = run_local(eng, prompt_tokens, progress=progress)
    if as_json:
        print(json.dumps(as_dict(result)))
        return
    _print_local(result, eng.card.summary())


def _print_local(result, summary: str) -> None:  # type: ignore[no-untyped-def]
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"kvmesh demo --local · {summary}")
    t.add_column("measure")
    t.add_column("value", justify="right")
    t.add_row("prompt tokens", str(result.prompt_tokens))
    t.add_row(
        "reused tokens",
        f"{result.reused_tokens} ({result.reused_tokens / result.prompt_tokens:.0%})",
    )
    t.add_row("cold prefill TTFT", f"{result.cold_ttft_s * 1000:.1f} ms")
    t.add_row("import TTFT", f"{result.hit_ttft_s * 1000:.1f} ms")
    t.add_row("speedup", f"{result.speedup:.0f}×")
    t.add_row("stored", f"{result.blocks} blocks / {result.bytes_stored / 2**20:.1f} MiB")
    t.add_row("outputs identical", "yes" if result.outputs_identical else "NO")
    Console().print(t)
    if not result.outputs_identical:
        sys.exit(1)


if __name__ == "__main__":  # pragma: no cover
    main()
