"""``ckptstore`` command line: parsing and presentation only; every action is a library call.

    ckptstore ls ROOT              committed (and uncommitted) steps with sizes and metrics
    ckptstore show ROOT [STEP]     keys of a step: dtype, shape, bytes, blobs; plain values
    ckptstore verify ROOT [STEP]   read and hash every blob; exit 1 if any step is damaged
    ckptstore gc ROOT              delete unreferenced blobs and crash leftovers
    ckptstore pull URL ROOT        copy committed steps of a remote store into a local one, verified

ROOT / URL: a local path, ``file://`` URL, or any fsspec URL (``s3://``, ``gs://``, ...); storage options
(endpoint, credentials) come from ``--storage-options JSON`` or ``$CKPTSTORE_STORAGE_OPTIONS``.

Exit status: 0 ok, 1 problems found (``verify``: a damaged step; ``gc``: unreadable steps), 2 usage or any
other error. An error is one line on stderr; ``--debug`` prints the traceback as well. Everything printed
that comes from a store (keys, values, metrics, messages) is printed as text, never as rich markup, and no
credential is ever printed (see :mod:`ckptstore.redact`).
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import sys
import traceback

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from .errors import CheckpointError
from .redact import redact, register_secrets
from .state import path_str

console = Console(highlight=False)


class Failure(click.ClickException):
    """An error of the command (not a finding): one line on stderr, exit status 2."""
    exit_code = 2

    def __init__(self, message: str):
        super().__init__(redact(message))


def _t(value, style: str = "") -> Text:
    """User data as rich Text: printed verbatim, never parsed as markup (a key may well contain ``[/x]``)."""
    return Text(redact(value if isinstance(value, str) else str(value)), style=style)


def _created(ts) -> str:
    try:
        return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
    except (OverflowError, OSError, ValueError, TypeError):
        return "?"


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _options(ctx_value):
    raw = ctx_value or os.environ.get("CKPTSTORE_STORAGE_OPTIONS")
    if not raw:
        return None
    try:
        opts = json.loads(raw)
    except (json.JSONDecodeError, RecursionError) as e:
        raise click.BadParameter(f"--storage-options is not JSON: {e}") from None
    if not isinstance(opts, dict):
        raise click.BadParameter("--storage-options must be a JSON object")
    register_secrets(opts)
    return opts


storage_options_opt = click.option("--storage-options", "storage_options", default=None, metavar="JSON",
                                   help="fsspec options for a remote URL (or $CKPTSTORE_STORAGE_OPTIONS).")


def _open(root, storage_options):
    from .store import Store
    return Store(root, storage_options=_options(storage_options), create=False)


class _Group(click.Group):
    """Turns every error into one clean line on stderr and exit status 2; ``--debug`` adds the traceback.
    Click's own exits (usage errors: 2, ``sys.exit`` of a command) pass through unchanged."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except KeyboardInterrupt:
            raise click.exceptions.Abort() from None
        except Exception as e:                                    # noqa: BLE001 - the point of this class
            if ctx.params.get("debug"):
                sys.stderr.write(redact("".join(traceback.format_exception(type(e), e, e.__traceback__))))
            msg = str(e) or type(e).__name__
            if not isinstance(e, (CheckpointError, OSError)):
                msg = f"{type(e).__name__}: {msg}"
            raise Failure(" ".join(msg.split()) if len(msg) < 2000 else msg[:2000]) from None


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", is_flag=True, help="Log what the library does.")
@click.option("--debug", is_flag=True, help="Print the traceback of an error.")
@click.version_option(package_name="ckptstore")
def main(verbose: bool, debug: bool) -> None:
    """Inspect and maintain ckptstore checkpoint stores."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(message)s")


@main.command("ls")
@click.argument("root")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@storage_options_opt
def ls_cmd(root, as_json, storage_options):
    """List the steps of a store: committed ones with size and metrics, and uncommitted leftovers."""
    with _open(root, storage_options) as store:
        committed = set(store.steps())
        latest = store.latest_step()
        rows = []
        for step in store.catalog.step_dirs():
            row = {"step": step, "committed": step in committed, "latest": step == latest}
            if step in committed:
                try:
                    c = store.commit_info(step)
                    row.update(created=c.created, bytes_total=c.bytes_total, world_size=c.world_size,
                               metrics=c.metrics)
                except CheckpointError as e:
                    row["error"] = str(e)
            rows.append(row)
    if as_json:
        click.echo(redact(json.dumps(rows, indent=1, default=str)))
        return
    console.print(_t(f"{root}: {len(committed)} committed step(s)"), soft_wrap=True)
    table = Table()
    for col in ("step", "state", "created (UTC)", "size", "ranks", "metrics"):
        table.add_column(col, justify="right" if col in ("step", "size", "ranks") else "left")
    for r in rows:
        state = _t("latest" if r["latest"] else "committed") if r["committed"] else _t("uncommitted", "yellow")
        if "error" in r:
            state = Text.assemble(_t("damaged", "red"), _t(f": {r['error']}"))
        created = _created(r["created"]) if "created" in r else ""
        metrics = " ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}"
                           for k, v in (r.get("metrics") or {}).items())
        table.add_row(str(r["step"]), state, created, _human(r["bytes_total"]) if "bytes_total" in r else "",
                      str(r.get("world_size", "")), _t(metrics))
    console.print(table)


@main.command("show")
@click.argument("root")
@click.argument("step", type=int, required=False)
@click.option("--rank", type=int, default=0, show_default=True)
@click.option("--values/--no-values", default=True, help="Print plain values too.")
@storage_options_opt
def show_cmd(root, step, rank, values, storage_options):
    """Show the keys of STEP (default: latest): dtype, shape, bytes and blobs of each tensor."""
    with _open(root, storage_options) as store:
        step = store.latest_step() if step is None else step
        if step is None:
            raise Failure(f"{root} has no committed step")
        if not store.catalog.is_committed(step):
            raise Failure(f"step {step} is not committed in {store.root}")
        commit = store.commit_info(step)
        manifest = store.catalog.read_manifest(commit, rank)
    console.print(_t(f"step {step}  rank {rank}/{commit.world_size}  {_human(manifest.bytes_total)} in "
                     f"{len(manifest.blob_ids())} blob(s)  written by {commit.writer or '?'}"))
    if commit.metrics:
        console.print(_t("metrics: " + json.dumps(commit.metrics, default=str)))
    if commit.config:
        console.print(_t("config: " + json.dumps(commit.config, default=str)))
    table = Table()
    for col in ("key", "kind", "dtype", "shape", "bytes", "blobs"):
        table.add_column(col, justify="right" if col in ("bytes", "blobs") else "left")
    for node in manifest.nodes:
        if not node.path or node.kind in ("dict", "list", "tuple"):
            continue
        key = path_str(node.path)
        if node.kind in ("tensor", "ndarray", "npscalar"):
            e = node.payload
            table.add_row(_t(key), node.kind, _t(e.dtype), "x".join(map(str, e.shape)) or "()", _human(e.nbytes),
                          str(len(e.chunks)))
        elif values:
            table.add_row(_t(key), node.kind, type(node.payload).__name__, _t(repr(node.payload)[:60]), "", "")
    console.print(table)


@main.command("verify")
@click.argument("root")
@click.argument("step", type=int, required=False)
@storage_options_opt
def verify_cmd(root, step, storage_options):
    """Read and hash every blob of STEP (default: every committed step). Exit status 1 if any is damaged."""
    with _open(root, storage_options) as store:
        results = store.verify(step)
    bad = 0
    for s, err in sorted(results.items()):
        if err is None:
            console.print(Text.assemble(f"step {s}: ", ("ok", "green")))
        else:
            bad += 1
            console.print(Text.assemble(f"step {s}: ", ("DAMAGED", "red"), " ", _t(err)))
    if not results:
        console.print("no committed step")
    sys.exit(1 if bad else 0)


@main.command("gc")
@click.argument("root")
@click.option("--grace", "grace_seconds", type=float, default=3600.0, show_default=True,
              help="Keep anything younger than this many seconds (protects saves in flight).")
@click.option("--dry-run", is_flag=True, help="Report what would be deleted.")
@click.option("--force", is_flag=True, help="Sweep even when some committed step is unreadable.")
@click.option("--repack", "repack", type=click.FloatRange(0, 1), default=0.5, show_default=True,
              help="Rewrite packs whose live bytes are below this fraction of their size (0: never).")
@click.option("--wait", "wait_seconds", type=float, default=600.0, show_default=True,
              help="Seconds to wait for saves / uploads in flight before deferring (nothing deleted).")
@storage_options_opt
def gc_cmd(root, grace_seconds, dry_run, force, repack, wait_seconds, storage_options):
    """Delete blobs no committed step references, uncommitted step directories and stale temp files."""
    with _open(root, storage_options) as store:
        r = store.gc(grace_seconds=grace_seconds, dry_run=dry_run, force=force, repack=repack or None,
                     wait_seconds=wait_seconds)
    if r.deferred:
        console.print(_t(f"gc deferred, nothing deleted: {'; '.join(r.deferred)}"))
        sys.exit(3)
    verb = "would delete" if dry_run else "deleted"
    console.print(_t(f"{verb} {r.blobs_deleted} blob(s), {r.packs_deleted} pack(s), {_human(r.bytes_freed)}; "
                     f"{len(r.steps_removed)} uncommitted step dir(s) {r.steps_removed or ''}; "
                     f"{r.temp_files_removed} temp file(s)"))
    if r.packs_repacked:
        console.print(_t(f"repacked {r.packs_repacked} pack(s) into {r.packs_written} ({_human(r.bytes_repacked)} "
                         f"live), steps {r.steps_rewritten}"))
    if r.unreadable_steps:
        console.print(Text.assemble(_t(f"unreadable steps {r.unreadable_steps}: blobs were not swept", "red"),
                                    " (use --force)"))
        sys.exit(1)


@main.command("pull")
@click.argument("url")
@click.argument("root")
@click.option("--step", type=int, default=None, help="Step to pull (default: the remote's newest committed step).")
@storage_options_opt
def pull_cmd(url, root, step, storage_options):
    """Copy a committed step of the store at URL into the local store ROOT, verifying every blob."""
    from .store import Store
    with Store(root, remote=url, storage_options=_options(storage_options), upload=False) as store:
        got = store.pull(step)
        steps = store.steps()
    console.print(_t(f"pulled step {got} into {root} (local steps: {steps})"))


if __name__ == "__main__":  # pragma: no cover
    main()
