"""``ckptstore`` command line: parsing and presentation only; every action is a library call.

    ckptstore ls ROOT [--remote URL] [--memory DIR]
                                               steps: time, ranks, size, bytes unique to the step, metrics,
                                               latest / best marked, where each is (with --remote / --memory)
    ckptstore show ROOT [--step N|latest|best] keys of a step: dtype, shape, bytes, chunks, sharding; ranks
    ckptstore verify ROOT [STEP]               read and hash every blob; exit 1 if any step is damaged
    ckptstore gc ROOT [--keep-last N] ...      apply a retention policy, then delete unreferenced blobs
    ckptstore pull URL --to DIR [--step ...]   copy a committed step into a local store, verified, resumable
    ckptstore export ROOT OUT [--key model]    the tensors of a step as .safetensors / .pt, verified

ROOT / URL: a local path, ``file://`` URL, or any fsspec URL (``s3://``, ``gs://``, ...); storage options
(endpoint, credentials) come from ``--storage-options JSON`` or ``$CKPTSTORE_STORAGE_OPTIONS``, the same on every
command and for every URL of a command. A step is a number, ``latest`` or ``best`` (see
:func:`ckptstore.lifecycle.retention.criterion` for what best means: ``--metric`` / ``--mode``, else the criterion
the newest commit recorded, else ``loss`` / ``min``).

Exit status: 0 ok, 1 problems found (``verify``, ``pull``: a damaged step; ``gc``: unreadable steps), 2 usage or
any other error, 3 ``gc`` deferred (saves in flight; nothing deleted by the sweep). An error is one line on
stderr; ``--debug`` prints the traceback as well. Everything printed that comes from a store (keys, values,
metrics, messages) is printed as text, never as rich markup, and no credential is ever printed (see
:mod:`ckptstore.util.redact`).
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import sys
import traceback
from typing import Any, Dict, List, Optional

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from .lifecycle import retention
from .util.errors import CheckpointError
from .util.redact import redact, register_secrets
from .state.flatten import path_str

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
    handler = logging.StreamHandler()
    handler.setFormatter(_LogFormatter(debug))
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, handlers=[handler])


class _LogFormatter(logging.Formatter):
    """Log lines of ckptstore and of the libraries under it (s3fs, gcsfs, botocore): one redacted line each;
    their tracebacks only with ``--debug``."""

    def __init__(self, debug: bool):
        super().__init__("%(levelname)s %(name)s: %(message)s")
        self.debug = debug

    def format(self, record: logging.LogRecord) -> str:
        if not self.debug and (record.exc_info or record.exc_text or record.stack_info):
            record = logging.makeLogRecord(record.__dict__)
            err = record.exc_info[1] if record.exc_info else None
            record.msg, record.args = f"{record.getMessage()}" + (f" ({type(err).__name__}: {err})" if err else ""), ()
            record.exc_info = record.exc_text = record.stack_info = None
        text = redact(super().format(record))
        return text if self.debug else " ".join(text.split())


# -- steps: a number, "latest" or "best" ---------------------------------------------------------------------
class StepSpec(click.ParamType):
    name = "N|latest|best"

    def convert(self, value, param, ctx):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("latest", "best"):
            return text
        try:
            n = int(text)
        except ValueError:
            self.fail(f"{value!r} is not a step number, 'latest' or 'best'", param, ctx)
        if n < 0:
            self.fail(f"step {n} is negative", param, ctx)
        return n


STEP = StepSpec()
metric_opt = click.option("--metric", default=None, metavar="NAME",
                          help="Metric that ranks steps for 'best' (default: the criterion the newest commit "
                               "recorded, else loss).")
mode_opt = click.option("--mode", type=click.Choice(retention.MODES), default=None,
                        help="best = smallest (min) or largest (max) metric (default: recorded, else min).")


def _commits(catalog, steps) -> Dict[int, Any]:
    """step -> Commit, or the error message (str) for a marker that cannot be read."""
    out: Dict[int, Any] = {}
    for s in steps:
        try:
            out[s] = catalog.read_commit(s)
        except CheckpointError as e:
            out[s] = str(e)
    return out


def _readable(commits: Dict[int, Any]):
    return [c for c in commits.values() if not isinstance(c, str)]


def _resolve_step(catalog, spec, metric, mode, where: str) -> int:
    """The committed step ``spec`` names (None: latest). Raises Failure."""
    steps = catalog.committed_steps()
    if spec is None or spec == "latest":
        if not steps:
            raise Failure(f"{where} has no committed step")
        return steps[-1]
    if spec == "best":
        commits = _readable(_commits(catalog, steps))
        crit = retention.criterion(commits, metric, mode)
        best = retention.best_step(commits, *crit)
        if best is None:
            raise Failure(f"{where}: no committed step has the metric {crit[0]!r} (see --metric)")
        return best
    if spec not in steps:
        raise Failure(f"step {spec} is not committed in {where}")
    return spec


def _step_arg(positional, option):
    if positional is not None and option is not None and positional != option:
        raise click.UsageError(f"step given twice: {positional} and --step {option}")
    return option if option is not None else positional


def _metrics_text(metrics) -> str:
    return " ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in (metrics or {}).items())


def _shape(shape) -> str:
    return "x".join(map(str, shape)) or "()"


# -- ls -----------------------------------------------------------------------------------------------------
@main.command("ls")
@click.argument("root")
@click.option("--remote", default=None, metavar="URL", help="Also list this store; say where each step is.")
@click.option("--memory", default=None, metavar="DIR",
              help="Also list this memory-tier root (Memory.root of the run, on this node); say where each step is.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@metric_opt
@mode_opt
@storage_options_opt
def ls_cmd(root, remote, memory, as_json, metric, mode, storage_options):
    """List the steps of a store: committed ones with time, ranks, size, bytes unique to the step and metrics
    (latest and best marked), uncommitted leftovers, and steps a resume set aside (no longer part of the run).
    With --remote and / or --memory (the run's memory-tier root), the steps of each and where each is: JSON
    ``tiers``, e.g. ``["memory", "local"]``, fastest first (and ``location``: local, remote or both, with
    --remote). A step's details come from the fastest tier holding it."""
    from .lifecycle.rewind import asides
    from .lifecycle.usage import step_usage
    places = ([("memory", memory)] if memory else []) + [("local", root)] + ([("remote", remote)] if remote else [])
    tiered = bool(remote or memory)
    seen: Dict[str, Dict[int, Any]] = {}
    usage: Dict[str, Dict[int, Any]] = {}
    dirs: List[int] = []
    aside_rows: List[Dict[str, Any]] = []
    for name, url in places:
        with _open(url, storage_options) as store:
            for a in asides(store.storage):
                aside_rows.append({"step": a.step, "committed": False, "latest": False, "best": False,
                                   "set_aside": a.name, "resumed": a.resumed, "since": a.since,
                                   **({"location": name} if remote else {}), **({"tiers": [name]} if tiered else {})})
            committed = store.steps()
            seen[name] = _commits(store.catalog, committed)
            usage[name] = step_usage(store.catalog, committed,
                                     {s: c for s, c in seen[name].items() if not isinstance(c, str)})
            if name == "local":
                dirs = store.catalog.step_dirs()
    committed = sorted(set().union(*(set(c) for c in seen.values())))
    info = {s: next((n, seen[n][s]) for n, _ in places if s in seen[n]) for s in committed}
    commits = [c for _, c in info.values() if not isinstance(c, str)]
    crit = retention.criterion(commits, metric, mode)
    best = retention.best_step(commits, *crit)
    latest = committed[-1] if committed else None
    rows = []
    for step in sorted(set(dirs) | set(committed)):
        row = {"step": step, "committed": step in committed, "latest": step == latest, "best": step == best}
        if remote:
            row["location"] = ("both" if step in seen["local"] and step in seen["remote"] else
                               next((n for n, _ in places if step in seen[n]), "local"))
        if tiered:
            row["tiers"] = [n for n, _ in places if step in seen[n]]
        if step in info:
            name, c = info[step]
            if isinstance(c, str):
                row["error"] = c
            else:
                u = usage[name][step]
                row.update(created=c.created, world_size=c.world_size, bytes_total=c.bytes_total,
                           bytes_unique=u.bytes_unique, metrics=c.metrics, names=list(c.names))
                if u.error:
                    row["error"] = u.error
        rows.append(row)
    rows = sorted(rows + aside_rows, key=lambda r: (r["step"], "set_aside" in r))
    if as_json:
        click.echo(redact(json.dumps(rows, indent=1, default=str)))
        return
    title = f"{root}: {len(seen['local'])} committed step(s)"
    if remote:
        title += f"; {remote}: {len(seen['remote'])}"
    if memory:
        title += f"; memory {memory}: {len(seen['memory'])}"
    console.print(_t(title), soft_wrap=True)
    if best is not None:
        console.print(_t(f"best: step {best} by {crit[0]} ({crit[1]})"), soft_wrap=True)
    table = Table()
    cols = ["step", "state", "created (UTC)", "ranks", "size", "unique", "metrics"] + (["where"] if tiered else [])
    for col in cols:
        table.add_column(col, justify="right" if col in ("step", "size", "ranks", "unique") else "left",
                         overflow="fold")
    for r in rows:
        if "set_aside" in r:
            state = _t(f"set aside (resumed from {r['resumed'] if r['resumed'] is not None else 'none'})",
                       "yellow")
        elif not r["committed"]:
            state = _t("uncommitted", "yellow")
        elif "error" in r:
            state = Text.assemble(_t("damaged", "red"), _t(f": {r['error']}"))
        else:
            marks = [m for m in ("latest", "best") if r[m]]
            state = _t(" ".join(marks) if marks else "committed", "bold" if marks else "")
        table.add_row(str(r["step"]), state, _created(r["created"]) if "created" in r else
                      _created(r["since"]) if r.get("since") is not None else "",
                      str(r.get("world_size", "")),
                      _human(r["bytes_total"]) if "bytes_total" in r else "",
                      _human(r["bytes_unique"]) if r.get("bytes_unique") is not None else "",
                      _t(" ".join(filter(None, [_metrics_text(r.get("metrics")),
                                                ", ".join(f"name={n}" for n in r.get("names") or [])]))),
                      *([_t(_where(r, memory))] if tiered else []))
    console.print(table)


def _where(row, memory) -> str:
    """The ``where`` column of ``ls``: ``local`` / ``remote`` / ``both`` with --remote alone (as before
    --memory existed); with --memory the tiers holding the step, fastest first (``memory+local``)."""
    return "+".join(row.get("tiers") or []) if memory else row.get("location", "")


# -- show ---------------------------------------------------------------------------------------------------
def _sharding(entry) -> Optional[Dict[str, Any]]:
    sh = getattr(entry, "shard", None)
    if sh is None:
        return None
    return {"global_shape": list(sh.global_shape), "offset": list(sh.offset), "mesh": list(sh.mesh),
            "placements": list(sh.placements)}


def _sharding_text(d) -> str:
    if d is None:
        return ""
    return f"{','.join(d['placements']) or '?'} mesh {_shape(d['mesh'])} @{','.join(map(str, d['offset']))}"


@main.command("show")
@click.argument("root")
@click.argument("step", type=STEP, required=False)
@click.option("--step", "step_opt", type=STEP, default=None, help="Step: N, latest (default) or best.")
@click.option("--rank", type=int, default=0, show_default=True, help="Whose keys to list.")
@click.option("--values/--no-values", default=True, help="Print plain values too.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@metric_opt
@mode_opt
@storage_options_opt
def show_cmd(root, step, step_opt, rank, values, as_json, metric, mode, storage_options):
    """Show the keys of a step (default: latest): dtype, shape, bytes, chunks and sharding of each tensor; for
    a step written by several ranks, the mesh, each rank's bytes and the sharded keys."""
    spec = _step_arg(step, step_opt)
    with _open(root, storage_options) as store:
        step = _resolve_step(store.catalog, spec, metric, mode, str(root))
        commit = store.commit_info(step)
        if not 0 <= rank < commit.world_size:
            raise Failure(f"step {step} was written by {commit.world_size} rank(s): no rank {rank}")
        manifests = {r: store.catalog.read_manifest(commit, r) for r in sorted(commit.manifests)}
        shard_map = None
        if commit.shards is not None:
            try:
                rl = store.catalog.read_shard_map(commit).rank_local
                shard_map = {"bytes": commit.shards[1], "rank_local": None if rl is None else
                             [path_str(p) for p in rl]}
            except CheckpointError as e:
                shard_map = {"bytes": commit.shards[1], "error": str(e)}
    manifest = manifests[rank]
    ranks, meshes = [], []
    for r, m in manifests.items():
        arrays = m.arrays()
        sharded = [e for n, e in arrays if n.kind == "dtensor"]
        for e in sharded:
            if list(e.shard.mesh) not in meshes:
                meshes.append(list(e.shard.mesh))
        ranks.append({"rank": r, "bytes": m.bytes_total, "tensors": len(arrays), "sharded": len(sharded),
                      "chunks": len({c.blob_id for _, e in arrays for c in e.chunks})})    # not delta keys
    keys = []
    for node in manifest.nodes:
        if not node.path or node.kind in ("dict", "list", "tuple"):
            continue
        row = {"key": path_str(node.path), "kind": node.kind}
        if node.kind in ("tensor", "dtensor", "ndarray", "npscalar"):
            e = node.payload
            row.update(dtype=e.dtype, shape=list(e.shape), bytes=e.nbytes, chunks=len(e.chunks),
                       sharding=_sharding(e))
        elif values:
            v = node.payload
            row.update(type=type(v).__name__,
                       value=v if isinstance(v, (str, int, float, bool, type(None))) else repr(v))
        else:
            continue
        keys.append(row)
    if as_json:
        doc = {"step": step, "world_size": commit.world_size, "rank": rank, "created": commit.created,
               "bytes_total": commit.bytes_total, "writer": commit.writer, "metrics": commit.metrics,
               "names": list(commit.names),
               "config": commit.config, "mesh": meshes, "ranks": ranks, "shard_map": shard_map, "keys": keys}
        click.echo(redact(json.dumps(doc, indent=1, default=str)))
        return
    console.print(_t(f"step {step}  {_created(commit.created)} UTC  world size {commit.world_size}  "
                     f"{_human(commit.bytes_total)} in all"))
    console.print(_t(f"written by {commit.writer or '?'}"))
    if commit.names:
        console.print(_t("names: " + ", ".join(commit.names)))
    if commit.metrics:
        console.print(_t("metrics: " + json.dumps(commit.metrics, default=str)))
    if commit.config:
        console.print(_t("config: " + json.dumps(commit.config, default=str)))
    if commit.world_size > 1 or meshes:
        console.print(_t("mesh: " + (", ".join(_shape(m) for m in meshes) if meshes else "none (no sharded key)")))
        rt = Table(title="ranks")
        for col in ("rank", "bytes", "tensors", "sharded", "chunks"):
            rt.add_column(col, justify="right")
        for r in ranks:
            rt.add_row(str(r["rank"]), _human(r["bytes"]), str(r["tensors"]), str(r["sharded"]), str(r["chunks"]))
        console.print(rt)
        if shard_map is not None:
            what = (f"unreadable: {shard_map['error']}" if "error" in shard_map else
                    "rank-local keys " + (", ".join(shard_map["rank_local"]) or "none")
                    if shard_map["rank_local"] is not None else "rank-local keys unknown")
            console.print(_t(f"shard map: {_human(shard_map['bytes'])}; {what}"))
    any_sharded = any(k.get("sharding") for k in keys)
    table = Table(title=f"keys of rank {rank}" if commit.world_size > 1 else None)
    table.add_column("key", overflow="fold", min_width=16)
    table.add_column("kind", overflow="fold")
    table.add_column("dtype", overflow="fold")
    table.add_column("shape", overflow="fold")
    table.add_column("bytes", justify="right", overflow="fold")
    table.add_column("chunks", justify="right", overflow="fold")
    if any_sharded:
        table.add_column("sharding", overflow="fold")
    for k in keys:
        if "dtype" in k:
            sh = k["sharding"]
            shape = _shape(k["shape"]) + (f" of {_shape(sh['global_shape'])}" if sh else "")
            table.add_row(_t(k["key"]), k["kind"], _t(k["dtype"]), shape, _human(k["bytes"]),
                          str(k["chunks"]), *([_t(_sharding_text(sh))] if any_sharded else []))
        else:
            plain = k["type"] in ("str", "int", "float", "bool", "NoneType")
            table.add_row(_t(k["key"]), k["kind"], k["type"], _t((repr(k["value"]) if plain else k["value"])[:60]),
                          "", "", *([""] if any_sharded else []))
    console.print(table)


# -- verify -------------------------------------------------------------------------------------------------
@main.command("verify")
@click.argument("root")
@click.argument("step", type=STEP, required=False)
@click.option("--step", "step_opt", type=STEP, default=None, help="Step: N, latest or best (default: all).")
@metric_opt
@mode_opt
@storage_options_opt
def verify_cmd(root, step, step_opt, metric, mode, storage_options):
    """Read and hash every blob of STEP (default: every committed step). Exit status 1 if any is damaged."""
    spec = _step_arg(step, step_opt)
    with _open(root, storage_options) as store:
        if spec is not None:
            spec = _resolve_step(store.catalog, spec, metric, mode, str(root))
        results = store.verify(spec)
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


# -- gc -----------------------------------------------------------------------------------------------------
@main.command("gc")
@click.argument("root")
@click.option("--keep-last", type=click.IntRange(1), default=None, help="Retention: keep the N newest steps.")
@click.option("--keep-every", type=click.IntRange(1), default=None,
              help="Retention: keep every step divisible by K.")
@click.option("--keep-best", type=click.IntRange(1), default=None,
              help="Retention: keep the N best steps by --metric / --mode.")
@metric_opt
@mode_opt
@click.option("--grace", "grace_seconds", type=float, default=3600.0, show_default=True,
              help="Keep anything younger than this many seconds (protects saves in flight).")
@click.option("--dry-run", is_flag=True, help="Report what would be deleted.")
@click.option("--force", is_flag=True, help="Sweep even when some committed step is unreadable.")
@click.option("--repack", "repack", type=click.FloatRange(0, 1), default=0.5, show_default=True,
              help="Rewrite packs whose live bytes are below this fraction of their size (0: never).")
@click.option("--wait", "wait_seconds", type=float, default=600.0, show_default=True,
              help="Seconds to wait for saves / uploads in flight before deferring (nothing deleted).")
@storage_options_opt
def gc_cmd(root, keep_last, keep_every, keep_best, metric, mode, grace_seconds, dry_run, force, repack,
           wait_seconds, storage_options):
    """Apply the retention policy given (--keep-last / --keep-every / --keep-best: a step any rule keeps is
    kept; the latest and the best step always are), deleting each dropped step commit marker first; then
    delete blobs no committed step references, uncommitted step directories and stale temp files."""
    from .lifecycle.usage import bytes_released, step_usage
    verb = "would delete" if dry_run else "deleted"
    with _open(root, storage_options) as store:
        if keep_last or keep_every or keep_best:
            steps = store.steps()
            commits = _commits(store.catalog, steps)
            crit = retention.criterion(_readable(commits), metric, mode)
            keep = retention.Retention(last=keep_last, every=keep_every, best=keep_best, metric=crit[0],
                                       mode=crit[1])      # the same policy objects Store(keep=...) uses
            infos = [retention.StepInfo(s, {} if isinstance(c, str) else (c.metrics or {}))
                     for s, c in commits.items()]         # an unreadable marker: no metrics, never best
            dropped = keep.to_delete(infos)
            usage = step_usage(store.catalog, steps, {s: c for s, c in commits.items() if not isinstance(c, str)})
            kept = [s for s in steps if s not in dropped]
            console.print(_t(f"retention (keep-last={keep_last}, keep-every={keep_every}, keep-best={keep_best} "
                             f"by {crit[0]} {crit[1]}): keeping {kept}"), soft_wrap=True)
            for s in dropped:
                if not dry_run:
                    store.delete_step(s)
                u = usage[s]
                console.print(_t(f"{verb} step {s}" + (f" ({_human(u.bytes_unique)} unique)"
                                                       if u.bytes_unique is not None else "")), soft_wrap=True)
            if dropped:
                console.print(_t(f"{verb} {len(dropped)} step(s); {_human(bytes_released(usage, dropped))} of "
                                 "chunks only they referenced become garbage"), soft_wrap=True)
        r = store.gc(grace_seconds=grace_seconds, dry_run=dry_run, force=force, repack=repack or None,
                     wait_seconds=wait_seconds)
    if r.deferred:
        console.print(_t(f"gc deferred, nothing swept: {'; '.join(r.deferred)}"))
        sys.exit(3)
    console.print(_t(f"{verb} {r.blobs_deleted} blob(s), {r.packs_deleted} pack(s), {_human(r.bytes_freed)}; "
                     f"{len(r.steps_removed)} uncommitted step dir(s) {r.steps_removed or ''}; "
                     f"{r.temp_files_removed} temp file(s)"), soft_wrap=True)
    if r.asides_removed:
        console.print(_t(f"{verb} {len(r.asides_removed)} set-aside step(s): {', '.join(r.asides_removed)}"),
                      soft_wrap=True)
    if r.packs_repacked:
        console.print(_t(f"repacked {r.packs_repacked} pack(s) into {r.packs_written} ({_human(r.bytes_repacked)} "
                         f"live), steps {r.steps_rewritten}"))
    console.print(_t(f"bytes freed: {r.bytes_freed} ({_human(r.bytes_freed)})" +
                     (" (dry run: the chunks of the steps retention would drop are not counted)"
                      if dry_run else "")), soft_wrap=True)
    if r.unreadable_steps:
        console.print(Text.assemble(_t(f"unreadable steps {r.unreadable_steps}: blobs were not swept", "red"),
                                    " (use --force)"))
        sys.exit(1)


# -- pull ---------------------------------------------------------------------------------------------------
def _progress_bar(enabled: bool):
    """A rich progress bar on stderr when it is a terminal (and ``enabled``), else None."""
    err = Console(stderr=True)
    if not enabled or not err.is_terminal:
        return None
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                               TransferSpeedColumn)
    return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                    TimeRemainingColumn(), console=err, transient=False)


@main.command("pull")
@click.argument("url")
@click.argument("root", required=False)
@click.option("--to", "to", default=None, metavar="DIR", help="Local store to copy into (or give it as ROOT).")
@click.option("--step", type=STEP, default=None, help="Step: N, latest (default) or best.")
@metric_opt
@mode_opt
@click.option("--progress/--no-progress", default=True, show_default=True,
              help="Progress bar (only on a terminal).")
@click.option("--verify/--no-verify", "check", default=True, show_default=True,
              help="Re-read and hash the whole pulled step in DIR afterwards.")
@storage_options_opt
def pull_cmd(url, root, to, step, metric, mode, progress, check, storage_options):
    """Copy a committed step of the store at URL into the local store DIR. Every object is verified against
    its hash on the way; the step's commit marker is written last, so an interrupted pull (even SIGKILL) leaves
    no committed partial step, and running it again copies only what is missing."""
    from .format.catalog import Catalog
    from .format.pointers import point_to_if_newest
    from .storage import open_storage
    from .store import Store
    from .remote.transfer import RANGED_PULL_THRESHOLD, StepCopier
    if root is not None and to is not None and root != to:
        raise click.UsageError(f"destination given twice: {root} and --to {to}")
    dest = to or root
    if dest is None:
        raise click.UsageError("missing destination: --to DIR")
    opts = _options(storage_options)
    src = open_storage(url, opts)
    try:
        step = _resolve_step(Catalog(src), step, metric, mode, src.url)
        with Store(dest, storage_options=opts) as store:
            bar = _progress_bar(progress)
            task = None

            def report(done, total):
                if bar is not None:
                    bar.update(task, completed=done, total=total)
            copier = StepCopier(src, store.storage, progress=report if bar is not None else None,
                                ranged=RANGED_PULL_THRESHOLD, pack_target=store.writing.packing.target_size)
            try:
                if bar is not None:
                    bar.start()
                    task = bar.add_task(f"step {step}", total=None)
                stats = copier.copy_step(step)
            finally:
                if bar is not None:
                    bar.stop()
                copier.close()
            point_to_if_newest(store.storage, store.catalog, step)   # as Store.pull: the pointer only moves forward
            result = store.verify(step)[step] if check else None
    finally:
        src.close()
    console.print(_t(f"pulled step {step} from {src.url} into {dest}: {stats.blobs_copied} of "
                     f"{stats.blobs_total} object(s) copied, {_human(stats.bytes_copied)} in {stats.seconds:.1f} s; "
                     f"fetched {_human(stats.bytes_fetched)}"
                     + (f" ({stats.packs_ranged} pack(s) by {stats.ranges_fetched} range(s))" if stats.packs_ranged
                        else "")),
                  soft_wrap=True)
    if check:
        if result is not None:
            console.print(Text.assemble(f"step {step}: ", ("DAMAGED", "red"), " ", _t(result)))
            sys.exit(1)
        console.print(Text.assemble(f"step {step}: ", ("verified", "green")))


# -- export -------------------------------------------------------------------------------------------------
@main.command("export")
@click.argument("root")
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--step", type=STEP, default=None, help="Step: N, latest (default) or best.")
@click.option("--key", default="model", show_default=True,
              help="Top-level key to export (nested: model/encoder; '' for the whole step).")
@click.option("--format", "fmt", type=click.Choice(["auto", "safetensors", "pt"]), default="auto",
              show_default=True, help="File format (auto: from OUT's extension, .safetensors or .pt).")
@metric_opt
@mode_opt
@storage_options_opt
def export_cmd(root, out, step, key, fmt, metric, mode, storage_options):
    """Write the tensors under KEY of a step to OUT as full tensors (sharded values consolidated), names
    joined with '.', as .safetensors or torch.save (.pt); the file is read back and compared before it is
    put in place. Non-tensor leaves are skipped (listed on stderr)."""
    from .io.export import export_step
    with _open(root, storage_options) as store:
        step = _resolve_step(store.catalog, step, metric, mode, str(root))
        rep = export_step(store, out, step=step, key=key,
                          fmt=None if fmt == "auto" else {"pt": "torch"}.get(fmt, fmt))
    if rep.skipped:
        shown = ", ".join(rep.skipped[:20]) + (f", ... ({len(rep.skipped)} in all)" if len(rep.skipped) > 20 else "")
        Console(stderr=True, highlight=False).print(
            _t(f"warning: skipped {len(rep.skipped)} non-tensor leaf/leaves: {shown}", "yellow"), soft_wrap=True)
    console.print(_t(f"exported step {step} key {key!r}: {rep.tensors} tensor(s), {_human(rep.bytes)} -> {out} "
                     f"({rep.format}, verified)"), soft_wrap=True)


if __name__ == "__main__":  # pragma: no cover
    main()
