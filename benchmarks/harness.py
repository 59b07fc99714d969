"""The one harness of the by-hand benchmarks: declare what is compared, run it alternated, report medians.

A benchmark declares its **contenders** (``Contender("torch.save+fsync", run)``: a name, a ``run`` callable and
optional ``setup`` / ``teardown`` that are not timed) and hands them to :func:`compare`, which runs every
contender once per repeat, the order reversed every other repeat (A B C, C B A, A B C, ...), so drift on a
shared machine (page cache, other jobs, thermal) hits every contender alike. Each run lands in a
:class:`Results` row as one sample: its seconds plus whatever metrics the run returns (bytes, requests, peak
memory, stall, ...). A contender whose one run yields several rows (a save, then its cold and warm loads)
records them itself through ``results.timed(row)`` / ``results.add(row, ...)``.

:meth:`Results.table` prints medians, min-max, ratios against named anchor rows and any metric columns, as
one plain-text table; :func:`write_json` writes every sample with the medians and ratios (``--json``). A failing
run is a table entry (``n/a: <error>``), not the end of the benchmark (``BENCH_DEBUG=1`` prints the
traceback). :func:`parser` gives every benchmark the same ``--repeat``, ``--json``, ``--dir``, ``--seed``
(and, where it has them, ``--size``, ``--no-verify``) flags.

Multi-rank benchmarks launch their ranks with :func:`launch` (tests/dist.py's ``Job``: ranks like torchrun,
gloo on 127.0.0.1) and write their rank side as ``rank_main(fn)``; the ranks alternate their contenders with
:func:`alternated` and the driver folds the slowest rank of each repeat into a row with :func:`fold`.

Nothing here imports ckptstore but :func:`environment` (for the banner and the JSON), so a benchmark can set
its ``CKPTSTORE_*`` variables first; a benchmark whose ckptstore API is missing prints ``n/a`` for those rows.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for _p in (str(REPO / "tests"), str(REPO), str(HERE)):   # ckptstore, backends and tests/ from this checkout
    if _p not in sys.path:
        sys.path.insert(0, _p)

import common as C  # noqa: E402

DEBUG = bool(os.environ.get("BENCH_DEBUG"))


# --------------------------------------------------------------------------- command line


def parser(doc: str | None, *, repeat: int | None = 3, sizes: Iterable[str] | None = None,
           size: str | None = None, scratch: bool = True, seed: bool = True, verify: bool = False,
           json_flag: bool = True) -> argparse.ArgumentParser:
    """An ArgumentParser with the flags every benchmark shares: ``--repeat N`` (runs per contender, median and
    min-max reported), ``--json PATH``, ``--dir PATH`` (scratch parent, default ``../bench_tmp``: the disk
    checkpoints go to, not tmpfs), ``--seed``, ``--size`` (from ``sizes``) and ``--no-verify``."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if repeat is not None:
        ap.add_argument("--repeat", type=int, default=repeat,
                        help=f"runs per contender, alternated (median, min-max); default {repeat}")
    if sizes is not None:
        sizes = list(sizes)
        ap.add_argument("--size", choices=sizes, default=size or sizes[0], help="state size")
    if json_flag:
        ap.add_argument("--json", metavar="PATH", help="also write every sample and setting as JSON")
    if scratch:
        ap.add_argument("--dir", default=str(C.default_bench_dir()),
                        help="scratch parent folder (on the disk you checkpoint to; not tmpfs)")
    if seed:
        ap.add_argument("--seed", type=int, default=0)
    if verify:
        ap.add_argument("--no-verify", dest="verify", action="store_false",
                        help="skip the checks of what was loaded (done on the first repeat, not timed)")
    return ap


def scratch_dir(path: str | Path, warn_tmpfs: bool = True) -> Path:
    """``--dir`` resolved and created; a warning when it is on tmpfs (the benchmark then measures RAM)."""
    base = Path(path).resolve()
    base.mkdir(parents=True, exist_ok=True)
    fs = C.fs_type(base)
    if warn_tmpfs and fs in ("tmpfs", "ramfs"):
        print(f"warning: --dir {base} is on {fs}: this measures RAM, not the disk", file=sys.stderr)
    return base


def environment() -> dict[str, Any]:
    """What the figures depend on: versions, CPUs, load average (also the JSON's ``env``)."""
    import torch
    try:
        import ckptstore
        ck = f"{getattr(ckptstore, '__version__', '?')} ({ckptstore.__file__})"
    except Exception as e:  # noqa: BLE001
        ck = "n/a: " + C.fmt_note(e)
    return dict(torch=torch.__version__, python=platform.python_version(), cpus=os.cpu_count(),
                torch_threads=torch.get_num_threads(), loadavg=round(os.getloadavg()[0], 2), ckptstore=ck,
                platform=platform.platform())


def banner(**extra: Any) -> str:
    e = environment()
    line = (f"torch {e['torch']}, python {e['python']}, {e['cpus']} cpus ({e['torch_threads']} torch threads), "
            f"load average {e['loadavg']:.2f}; ckptstore {e['ckptstore']}")
    return line + "".join(f"; {k} {v}" for k, v in extra.items())


# --------------------------------------------------------------------------- results


def med(xs: Iterable[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


@dataclass
class Row:
    """One row of a table: a sample per run (``{"seconds": s, <metric>: value, "note": ...}``) and flags
    (``n/a: <error>``, ``WRONG DATA``). Its note is the last run's note, then the flags."""
    name: str
    group: str = ""
    samples: list[dict[str, Any]] = field(default_factory=list)
    flags: str = ""

    @property
    def note(self) -> str:
        last = next((s["note"] for s in reversed(self.samples) if s.get("note")), "")
        return " ".join(x for x in (last, self.flags) if x)

    def values(self, key: str = "seconds") -> list[Any]:
        return [s[key] for s in self.samples if s.get(key) is not None]

    def median(self, key: str = "seconds") -> float | None:
        return med(self.values(key))

    def span(self, key: str = "seconds", fmt: str = "{:.3f}") -> str:
        xs = self.values(key)
        return f"{fmt.format(min(xs))}-{fmt.format(max(xs))}" if xs else "n/a"


Anchor = str | Callable[[Row], str | None]


class Results:
    """Rows in declaration order. ``rep`` is the repeat being run (``first``: it is the first, where the
    benchmarks verify what they load). ``ratios`` / ``columns``: what :meth:`table` shows by default."""

    def __init__(self, ratios: dict[str, Anchor] | None = None,
                 columns: Sequence[tuple[str, Callable[[Row], str]]] = ()) -> None:
        self.rows: dict[str, Row] = {}
        self.rep = 0
        self.ratios, self.columns = dict(ratios or {}), list(columns)   # the defaults of table() / to_json()

    @property
    def first(self) -> bool:
        return self.rep == 0

    def declare(self, *names: str, group: str = "") -> "Results":
        for n in names:
            self.rows.setdefault(n, Row(n, group))
        return self

    def row(self, name: str) -> Row:
        return self.rows.setdefault(name, Row(name))

    def add(self, name: str, seconds: float | None = None, **metrics: Any) -> dict[str, Any]:
        """One sample of ``name`` (``note=`` among the metrics: shown while it is the last run's)."""
        s = {"seconds": seconds, **metrics}
        self.row(name).samples.append(s)
        return s

    def note(self, name: str, text: str) -> None:
        r = self.row(name)
        if text not in r.flags:
            r.flags = f"{r.flags} {text}".strip()

    def check(self, name: str, ok: bool) -> None:
        """A failed verification: ``WRONG DATA`` in the row's note."""
        if not ok:
            self.note(name, "WRONG DATA")

    def fail(self, names: Iterable[str], e: BaseException) -> None:
        """These rows could not be measured: ``n/a: <error>`` (traceback with BENCH_DEBUG=1)."""
        for n in names:
            self.row(n).flags = "n/a: " + C.fmt_note(e)
        if DEBUG:
            traceback.print_exception(e)

    @contextlib.contextmanager
    def timed(self, name: str, memory: bool = False) -> Iterator[dict[str, Any]]:
        """Time the block as one sample of ``name``. The yielded dict IS the sample: put metrics (and
        ``note``) in it, in the block or after it; ``seconds`` set in the block is kept (a block that times
        only part of itself). ``memory``: also ``peak``, the peak RSS above the RSS at the start
        (common.PeakRSS). An exception records nothing and goes on up (compare marks the rows n/a)."""
        m: dict[str, Any] = {}
        probe = C.PeakRSS() if memory else None
        if probe:
            probe.start()
        t0 = time.perf_counter()
        yield m
        m.setdefault("seconds", time.perf_counter() - t0)
        if probe:
            m.setdefault("peak", probe.peak())
        self.row(name).samples.append(m)

    def ratio(self, name: str, anchor: Anchor | None, key: str = "seconds") -> float | None:
        row = self.rows.get(name)
        ref = anchor(row) if callable(anchor) and row else anchor
        if row is None or not ref or ref not in self.rows:
            return None
        a, b = row.median(key), self.rows[ref].median(key)
        return a / b if a is not None and b else None

    # -- output
    def table(self, *, ratios: dict[str, Anchor] | None = None, columns: Sequence[tuple[str, Callable]] | None = None,
              head: str = "method", key: str = "seconds", unit: str = "s", fmt: str = "{:.3f}",
              rows: Iterable[str] | None = None, note: bool = True) -> str:
        """Name, median and min-max of ``key``, then ``x <anchor>`` ratios of medians (above 1: slower or
        larger than the anchor), then ``columns`` (header, row -> cell), then the note."""
        ratios = self.ratios if ratios is None else ratios
        columns = self.columns if columns is None else columns
        lines = [[head, f"median {unit}", f"min-max {unit}", *ratios, *(h for h, _ in columns)]
                 + (["note"] if note else [])]
        for name in rows if rows is not None else self.rows:
            r = self.rows.get(name)
            if r is None:
                continue
            m = r.median(key)
            cells = [name, fmt.format(m) if m is not None else "n/a", r.span(key, fmt)]
            for anchor in ratios.values():
                x = self.ratio(name, anchor, key)
                none = callable(anchor) and not anchor(r)            # a row without an anchor: blank
                cells.append(f"{x:.2f}" if x is not None else "" if none else "n/a")
            cells += [fn(r) if r.samples else "" for _, fn in columns]
            lines.append(cells + ([r.note] if note else []))
        return C.align_table(lines)

    def to_json(self, ratios: dict[str, Anchor] | None = None, key: str = "seconds") -> list[dict[str, Any]]:
        out = []
        for name, r in self.rows.items():
            xs = r.values(key)
            out.append(dict(name=name, group=r.group, median=r.median(key), min=min(xs) if xs else None,
                            max=max(xs) if xs else None, note=r.note, samples=r.samples,
                            **{h.replace(" ", "_"): self.ratio(name, a, key)
                               for h, a in (self.ratios if ratios is None else ratios).items()}))
        return out


def write_json(path: str | None, args: argparse.Namespace | None = None, **sections: Any) -> None:
    """``--json``: the environment, the arguments and each section (a Results becomes its rows)."""
    if not path:
        return
    out: dict[str, Any] = {"env": environment(), "args": vars(args) if args is not None else None}
    for k, v in sections.items():
        out[k] = v.to_json() if isinstance(v, Results) else v
    Path(path).write_text(json.dumps(out, indent=1, default=str))
    print(f"wrote {path}")


# --------------------------------------------------------------------------- contenders


@dataclass
class Contender:
    """One thing compared. ``run(ctx)`` is timed as one sample of ``name`` and may return a dict of metrics
    (bytes, requests, stall, ``note``...); ``ctx`` is what ``setup()`` returned (not timed), given to
    ``teardown(ctx)`` after the run, failed or not. With ``records=True`` the run is not timed by the harness:
    ``run(results, ctx)`` records its own rows (``results.timed``, ``results.add``), and ``rows`` names them
    (those it did not measure are marked n/a when it raises)."""
    name: str
    run: Callable[..., Any]
    setup: Callable[[], Any] | None = None
    teardown: Callable[[Any], None] | None = None
    records: bool = False
    rows: Sequence[str] = ()
    group: str = ""


def order(items: Sequence[Any], rep: int) -> list[Any]:
    """The items in the order of repeat ``rep``: as given, reversed every other repeat (A B C, C B A, ...)."""
    return list(items) if rep % 2 == 0 else list(reversed(items))


def alternated(items: Sequence[Any], repeat: int) -> Iterator[tuple[int, Any]]:
    """(repeat, item): every item once per repeat, in :func:`order`."""
    for rep in range(repeat):
        for it in order(items, rep):
            yield rep, it


def failed(res: Results, c: Contender, rep: int, e: BaseException) -> None:
    """A run of ``c`` raised: its rows with fewer samples than repeats run are n/a (the others keep their
    sample; a row takes one sample a repeat); when every row was measured, the last one's note says so."""
    rows = list(c.rows or (c.name,))
    missing = [r for r in rows if len(res.row(r).samples) <= rep]
    if missing:
        res.fail(missing, e)
    else:
        res.note(rows[-1], "then failed: " + C.fmt_note(e))


def compare(contenders: Sequence[Contender], repeat: int, results: Results | None = None,
            progress: bool = True) -> Results:
    """Run every contender ``repeat`` times, alternated; a run that raises marks its rows not measured in
    that repeat n/a, and the others go on. Progress goes to stderr, one line per run."""
    res = results or Results()
    for c in contenders:
        res.declare(*(c.rows or (c.name,)), group=c.group)
    for rep, c in alternated(contenders, repeat):
        res.rep = rep
        t0 = time.perf_counter()
        ctx = None
        try:
            ctx = c.setup() if c.setup else None
            if c.records:
                c.run(res, ctx)
            else:
                t = time.perf_counter()
                out = c.run(ctx) if c.setup else c.run()
                secs = time.perf_counter() - t
                out = dict(out or {})
                res.add(c.name, out.pop("seconds", secs), **out)
        except Exception as e:  # noqa: BLE001 - one contender's failure is a table entry
            failed(res, c, rep, e)
        finally:
            if c.teardown:
                try:
                    c.teardown(ctx)
                except Exception as e:  # noqa: BLE001
                    failed(res, c, rep, e)
        if progress:
            print(f"  run {rep + 1}/{repeat} {c.name:<36} {time.perf_counter() - t0:7.2f} s", file=sys.stderr,
                  flush=True)
    return res


# --------------------------------------------------------------------------- multi-rank jobs


def launch(world: int, script: str | Path, *args: str, env: dict[str, str] | None = None,
           timeout: float = 1800) -> list[dict]:
    """Run ``script`` as ``world`` ranks launched like torchrun (tests/dist.py: RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR=127.0.0.1, OMP_NUM_THREADS=1, gloo on lo); every rank's ``RESULT`` dict, by rank. Raises
    with the failed ranks' output when one exits non-zero or prints no result."""
    from dist import Job
    job = Job(world, *map(str, args), env=env, script=Path(script))
    try:
        out = job.check(timeout)
    except AssertionError as e:
        raise RuntimeError(f"{Path(script).name} {' '.join(map(str, args))[:200]}: {e}") from None
    missing = [r for r, v in out.items() if v is None]
    if missing:
        raise RuntimeError(f"ranks {missing} printed no RESULT:\n" + job.outputs[missing[0]][-3000:])
    return [out[r] for r in range(world)]


def rank_main(fn: Callable[[int, int], dict | None], backend: str = "gloo") -> None:
    """The rank side of a launched job: join the process group, ``fn(rank, world)``, print its dict as the
    rank's ``RESULT`` line, leave together (barrier, destroy, exit at once). A
    failure prints its traceback and exits 1, so :func:`launch` shows it."""
    import torch.distributed as dist
    dist.init_process_group(backend)
    try:
        out = fn(dist.get_rank(), dist.get_world_size())
        if out is not None:
            print("RESULT " + json.dumps(out, default=str), flush=True)
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    dist.barrier()                  # leave together: rank 0 hosts the key-value store (tests/dist_worker.finish)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)                     # interpreter teardown after destroy_process_group may abort


def fold(res: Results, ranks: list[dict], name: str, row: str | None = None,
         extra: Callable[[list[dict]], dict] | None = None) -> Row:
    """Rank results ``{"samples": {name: [rec per repeat]}, "wrong": [names]}`` into row ``row``: per repeat
    one sample, the slowest rank's ``s`` (ranks start each repeat after a barrier) as its seconds, the largest
    ``peak``, and ``extra(recs of every rank)``; ``WRONG DATA`` when a rank's check of ``name`` failed."""
    row = row or name
    for i in range(len(ranks[0]["samples"][name])):
        recs = [r["samples"][name][i] for r in ranks]
        peaks = [x["peak"] for x in recs if x.get("peak") is not None]
        res.add(row, max(x["s"] for x in recs), peak=max(peaks) if peaks else None, **(extra(recs) if extra else {}))
    res.check(row, not any(name in r.get("wrong", ()) for r in ranks))
    return res.rows[row]


def pct(xs: Sequence[float], q: float) -> float:
    """The q-th percentile (nearest rank) of ``xs``."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]
