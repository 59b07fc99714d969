"""Shared helpers for the by-hand benchmarks in this folder (harness.py runs and reports them):

* the GPT + AdamW state every single-process benchmark saves (``build_state``, ``SIZES``), its tensors,
  fingerprints (CRC32) and the one-byte perturbation that makes an in-place load prove itself;
* files: scratch folders, fsync, page-cache eviction, bytes on disk, the files a store left (``count_files``);
* the anchors: raw O_DIRECT write / read (``raw_write`` / ``raw_read``: the disk's limit), ``torch.save`` +
  fsync (``torch_save_fsync``), DCP's ``AppState``;
* memory: RSS, the VmHWM reset and ``PeakRSS`` (peak above a baseline), ``MALLOC_ENV`` for measured children;
* moto: CPU seconds of the server and this process, a boto3 client;
* formatting: bytes, notes, the plain-text table.

Nothing here imports ckptstore: the benchmarks must run (printing "n/a") while the package is still being written.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import mmap
import os
import resource
import shutil
import tempfile
import time
import warnings
import zlib
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
MiB = 1 << 20
ALIGN = 4096  # O_DIRECT alignment used for buffer address, file offset and length

# --------------------------------------------------------------------------- model

# total state = 12 bytes/param (fp32 weights + AdamW exp_avg + exp_avg_sq) + a few scalars
SIZES: dict[str, dict[str, int]] = {
    #            width      depth      vocab          heads        ~params  ~state
    "small": dict(d_model=512, n_layers=4, vocab=8192, n_heads=8),    # 21 M   0.25 GB
    "1gb": dict(d_model=768, n_layers=8, vocab=16384, n_heads=12),    # 82 M   0.98 GB
    "3gb": dict(d_model=1024, n_layers=16, vocab=24576, n_heads=16),  # 252 M  3.03 GB
}
CONTEXT = 256


class Block(nn.Module):
    def __init__(self, d: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fc2(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """GPT-2-style decoder (untied head so every parameter has its own storage)."""

    def __init__(self, d_model: int, n_layers: int, vocab: int, n_heads: int):
        super().__init__()
        self.wte = nn.Embedding(vocab, d_model)
        self.wpe = nn.Embedding(CONTEXT, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def build_state(size: str, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Deterministic model + AdamW after exactly one optimizer step."""
    cfg = SIZES[size]
    torch.manual_seed(seed)
    model = GPT(**cfg)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=3e-4, betas=(0.9, 0.95),
    )
    g = torch.Generator().manual_seed(seed + 1)
    idx = torch.randint(0, cfg["vocab"], (2, 32), generator=g)
    logits = model(idx[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    del logits, loss
    gc.collect()
    return model, opt


def state_tensors(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor of the training state, in a fixed order (re-collect after a load:
    optimizer.load_state_dict may replace the state tensors)."""
    out = [t.detach() for t in model.state_dict().values()]
    for p in (p for g in opt.param_groups for p in g["params"]):
        for k in sorted(opt.state.get(p, {})):
            v = opt.state[p][k]
            if torch.is_tensor(v):
                out.append(v.detach())
    return out


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def crc(t: torch.Tensor) -> int:
    b = as_bytes(t)  # no numpy needed: wrap the tensor memory with ctypes
    return zlib.crc32((ctypes.c_char * b.numel()).from_address(b.data_ptr())) if b.numel() else 0


def fingerprint(tensors: Iterable[torch.Tensor]) -> list[tuple[int, int]]:
    """Order-independent fingerprint: sorted (nbytes, crc32) of tensors with >1 element
    (0-dim AdamW `step` counters are skipped: containers store them differently)."""
    return sorted((nbytes(t), crc(t)) for t in tensors if t.numel() > 1)


def tree_items(obj: Any, path: tuple = ()) -> Iterator[tuple[str, torch.Tensor]]:
    """(key path "a/b/0", tensor) for every tensor of a nested dict/list/tuple; keys as strings, so a live
    state dict and a loaded one line up."""
    if torch.is_tensor(obj):
        yield "/".join(map(str, path)), obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from tree_items(v, path + (k,))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from tree_items(v, path + (i,))


def tree_tensors(obj: Any) -> Iterator[torch.Tensor]:
    return (t for _, t in tree_items(obj))


@contextlib.contextmanager
def perturbed(tensors: list[torch.Tensor]) -> Iterator[None]:
    """Flip one byte of every tensor (so an in-place load must really write it); the bytes
    are put back on exit if the load did not restore them, so a broken loader cannot
    corrupt the state that later methods save."""
    saved = []
    for t in tensors:
        b = as_bytes(t)
        if b.numel() and b.data_ptr() == t.data_ptr():
            saved.append((b, int(b[0])))
            b[0] = (int(b[0]) + 1) % 256
    try:
        yield
    finally:
        for b, v in saved:
            b[0] = v


# --------------------------------------------------------------------------- files


def fs_type(path: Path) -> str:
    best, kind = "", "?"
    p = str(path.resolve())
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            mnt, typ = parts[1], parts[2]
            if (p == mnt or p.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                best, kind = mnt, typ
    return kind


def default_bench_dir() -> Path:
    """A scratch folder next to the repo (same disk as a real run); /tmp only if it is
    not tmpfs."""
    return REPO.parent / "bench_tmp"


def fresh_dir(base: Path, prefix: str) -> Path:
    base.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=prefix, dir=base))


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def evict(path: Path) -> None:
    """Drop a file / folder tree from the page cache without root: fsync then
    POSIX_FADV_DONTNEED on every file (clean pages are discarded)."""
    paths = [path] if path.is_file() else [Path(r) / n for r, _, fs in os.walk(path) for n in fs]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum((Path(r) / n).stat().st_size for r, _, fs in os.walk(path) for n in fs
               if not (Path(r) / n).is_symlink())


def rmtree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


# --------------------------------------------------------------------------- raw I/O


def _round_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def _write_all(fd: int, view: memoryview) -> None:
    off = 0
    while off < len(view):
        off += os.write(fd, view[off:])


def raw_write(tensors: list[torch.Tensor], path: Path, block: int = 64 * MiB,
              direct: bool = True) -> tuple[int, float]:
    """Concatenate the tensor bytes into a page-aligned 64 MiB staging buffer and write
    it with O_DIRECT, single thread; pad the last block, ftruncate, fsync.
    Returns (bytes, seconds spent in write/fsync calls)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o644)
    buf = mmap.mmap(-1, block)  # anonymous mmap: page aligned
    view = memoryview(buf)
    stage = torch.frombuffer(buf, dtype=torch.uint8)
    fill = total = 0
    io_s = 0.0
    try:
        for t in tensors:
            src = as_bytes(t)
            off, n_src = 0, src.numel()
            while off < n_src:
                n = min(block - fill, n_src - off)
                stage[fill:fill + n].copy_(src[off:off + n])
                fill += n
                off += n
                if fill == block:
                    t0 = time.perf_counter()
                    _write_all(fd, view)
                    io_s += time.perf_counter() - t0
                    total += fill
                    fill = 0
        t0 = time.perf_counter()
        if fill:
            padded = _round_up(fill)
            stage[fill:padded].zero_()
            _write_all(fd, view[:padded])
            total += fill
        os.ftruncate(fd, total)
        os.fsync(fd)
        io_s += time.perf_counter() - t0
    finally:
        os.close(fd)
        del stage, view
        buf.close()
    return total, io_s


def raw_read(templates: list[torch.Tensor], path: Path, block: int = 64 * MiB,
             direct: bool = True) -> tuple[list[torch.Tensor], float]:
    """Read the raw file back with O_DIRECT (bypasses the page cache) through the aligned
    staging buffer into freshly allocated tensors shaped like `templates`.
    Returns (tensors, seconds spent in read calls)."""
    out = [torch.empty(t.shape, dtype=t.dtype) for t in templates]
    dsts = [as_bytes(t) for t in out]
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    buf = mmap.mmap(-1, block)
    view = memoryview(buf)
    stage = torch.frombuffer(buf, dtype=torch.uint8)
    try:
        file_off = 0
        avail = pos = 0
        io_s = 0.0
        for dst in dsts:
            off, n_dst = 0, dst.numel()
            while off < n_dst:
                if pos == avail:
                    t0 = time.perf_counter()
                    avail = os.preadv(fd, [view], file_off)
                    io_s += time.perf_counter() - t0
                    if avail <= 0:
                        raise EOFError(f"{path}: short file at {file_off}")
                    file_off += avail
                    pos = 0
                n = min(avail - pos, n_dst - off)
                dst[off:off + n].copy_(stage[pos:pos + n])
                pos += n
                off += n
    finally:
        os.close(fd)
        del stage, view
        buf.close()
    return out, io_s


def o_direct_supported(base: Path) -> bool:
    fd = None
    p = base / ".odirect_probe"
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        buf = mmap.mmap(-1, ALIGN)
        os.write(fd, buf)
        return True
    except OSError:
        return False
    finally:
        if fd is not None:
            os.close(fd)
        with contextlib.suppress(OSError):
            p.unlink()


# --------------------------------------------------------------------------- memory


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def malloc_trim() -> None:
    """Give free heap memory back to the OS (glibc only)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def reset_peak_rss() -> bool:
    """Reset the high-water RSS mark (VmHWM, what ru_maxrss reports for this mm); Linux >= 4.0."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """This process's high-water RSS in bytes: VmHWM of /proc/self/status (the mm's own mark, which
    reset_peak_rss() resets), else getrusage's ru_maxrss. ru_maxrss is not used first: it is the larger of
    that mark and the maxrss carried over at exec from the process that forked it, so a child forked by a
    parent holding a big state (a bench driver that has just uploaded one) reports the parent's peak."""
    hwm = proc_kib("/proc/self/status", "VmHWM")
    return hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def proc_kib(path: str, key: str) -> int | None:
    """A ``key:  N kB`` line of a /proc file (status, meminfo) in bytes, or None when it is not there."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# fixed glibc thresholds for processes whose peaks are measured: big buffers are mmapped and handed back on
# free, so memory freed by an earlier phase is not silently reused (which would hide part of the next peak)
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}


class PeakRSS:
    """Peak RSS above the RSS at ``start()``: gc, malloc_trim, RSS, then the high-water mark reset."""

    def start(self) -> None:
        gc.collect()
        malloc_trim()
        self.base = rss_bytes()
        self.ok = reset_peak_rss()

    def peak(self) -> int | None:
        return max(0, peak_rss_bytes() - self.base) if self.ok else None


# --------------------------------------------------------------------------- table / formatting


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "n/a"
    return f"{n / MiB:,.0f} MiB" if n >= 10 * MiB or n == 0 else f"{n / MiB:,.2f} MiB"


def mib(n: float | None, nd: int = 1) -> str:
    return "n/a" if n is None else f"{n / MiB:,.{nd}f}"


def align_table(lines: list[list]) -> str:
    """Columns padded to their widest cell (first and last left-aligned, the rest right-aligned), a rule of
    dashes under the first line (the header)."""
    head = lines[0]
    widths = [max(len(str(l[i])) for l in lines) for i in range(len(head))]
    out = []
    for i, l in enumerate(lines):
        out.append("  ".join(str(c).ljust(w) if j in (0, len(l) - 1) else str(c).rjust(w)
                             for j, (c, w) in enumerate(zip(l, widths))).rstrip())
        if i == 0:
            out.append("-" * len(out[0]))
    return "\n".join(out)


def gb(n: int) -> str:
    return f"{n / 1e9:.3f} GB"


def fmt_note(e: BaseException) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    msg = f"{type(e).__name__}: {msg}" if msg else type(e).__name__
    return msg if len(msg) <= 70 else msg[:67] + "..."


# --------------------------------------------------------------------------- the anchors: torch.save, DCP


def torch_save_fsync(obj: Any, path: Path) -> int:
    """``torch.save(obj)`` into ``path``, then fsync of the file and its folder (durable, as a ckptstore
    commit is). Returns the file's bytes."""
    with open(path, "wb") as fh:
        torch.save(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())
    fsync_path(path.parent)
    return path.stat().st_size


def quiet_dcp() -> None:
    """DCP without a process group warns on every call ("torch.distributed is disabled ..."), and its
    deprecations are FutureWarnings: neither says anything about the figures."""
    warnings.filterwarnings("ignore", message=r".*torch\.distributed is disabled.*")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed.*")
    warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed.*")


class AppState:
    """The DCP tutorial's Stateful: model + optimizer through get_state_dict / set_state_dict (FQN keys; the
    live tensors, so ``dcp.load`` loads in place). Both libraries save ``{"app": AppState(model, optim)}``."""

    def __init__(self, model: nn.Module, optim: torch.optim.Optimizer):
        self.model, self.optim = model, optim

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict
        m, o = get_state_dict(self.model, self.optim)
        return {"model": m, "optim": o}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict
        set_state_dict(self.model, self.optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def result_note(res: Any) -> str:
    """A ckptstore ``SaveResult`` in a few words: bytes written, new blobs, blobs, stall_seconds."""
    parts = []
    for attr, label in (("bytes_written", "written"), ("blobs_new", "new blobs"), ("blobs_total", "blobs")):
        v = getattr(res, attr, None)
        if isinstance(v, int):
            parts.append(f"{label} {fmt_bytes(v) if attr == 'bytes_written' else v}")
    v = getattr(res, "stall_seconds", None)
    if isinstance(v, (int, float)):
        parts.append(f"stall_seconds {v:.3f}")
    return ", ".join(parts)


def count_files(root: Path, step: int) -> dict[str, dict[str, int]]:
    """Files under a store root by area: objects, packs, steps/<step>, root (files directly in the root: marker,
    latest pointer), other:<dir>; per area: files, apparent bytes, allocated bytes (st_blocks), plus folders."""
    out: dict[str, dict[str, int]] = {}
    for dirpath, dirs, files in os.walk(root):
        parts = Path(dirpath).relative_to(root).parts
        if not parts:
            area = "root"
        elif parts[0] in ("objects", "packs"):
            area = parts[0]
        elif parts[0] == "steps" and (len(parts) == 1 or (parts[1].isdigit() and int(parts[1]) == step)):
            area = "steps/<step>"                     # the step's folder (and steps/ itself, on a fresh store)
        else:
            area = "other:" + "/".join(parts[:2])
        rec = out.setdefault(area, {"files": 0, "bytes": 0, "allocated": 0, "dirs": 0})
        rec["dirs"] += len(dirs)
        for n in files:
            st = os.lstat(os.path.join(dirpath, n))
            rec["files"] += 1
            rec["bytes"] += st.st_size
            rec["allocated"] += st.st_blocks * 512
    out["total"] = {k: sum(v[k] for v in out.values()) for k in ("files", "bytes", "allocated", "dirs")}
    return out


# --------------------------------------------------------------------------- processes, moto


CLK_TCK = os.sysconf("SC_CLK_TCK")


def proc_cpu(pids: list[int]) -> float:
    """user+system CPU seconds of ``pids`` (all their threads), e.g. the moto server's."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])      # utime, stime
        except OSError:
            pass
    return total / CLK_TCK


def self_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


@contextlib.contextmanager
def cpu_seconds(server_pids: list[int]) -> Iterator[dict[str, float]]:
    """The yielded dict gets ``moto_cpu`` (CPU seconds of the server's processes) and ``client_cpu`` (of
    this process) spent in the block."""
    out: dict[str, float] = {}
    m0, c0 = proc_cpu(server_pids), self_cpu()
    yield out
    out.update(moto_cpu=proc_cpu(server_pids) - m0, client_cpu=self_cpu() - c0)


def boto3_client(server: Any, concurrency: int = 8) -> Any:
    """A boto3 S3 client for a backends.launcher.S3Server (path-style, pool >= ``concurrency``)."""
    import boto3
    from botocore.config import Config
    return boto3.client("s3", endpoint_url=server.endpoint, aws_access_key_id=server.key,
                        aws_secret_access_key=server.secret, region_name=server.region,
                        config=Config(s3={"addressing_style": "path"}, max_pool_connections=max(10, concurrency)))
