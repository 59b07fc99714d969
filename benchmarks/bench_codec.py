#!/usr/bin/env python
"""Issue 30: the codecs for new chunks on a state trained here, side by side, per tensor class and per core.

    taskset -c 0 .venv/bin/python benchmarks/bench_codec.py [--steps 300] [--repeat 3] [--dir ../bench_tmp]

The state: a small GPT (benchmarks/common.py's ``GPT``: d_model 256, 4 layers, byte vocabulary) trained with
AdamW for ``--steps`` steps on the bytes of this repository's ``ckptstore/*.py`` (batch 8 x 64; nothing tuned for
the codec), and a bfloat16 copy of its weights. Tensor classes: fp32 weights, Adam ``exp_avg`` (m), Adam
``exp_avg_sq`` (v), bf16 weights; every tensor is coded on its own (one chunk each, as a save stores them).

1. Per class and codec: stored/raw ratio (raw bytes / stored bytes), compress and decompress GB/s of raw bytes
   per core (CPU seconds of this process, best of ``--repeat``; run it under ``taskset -c 0``), round trip checked.
   Codecs: zstd levels 1 and 3 (one frame per tensor), ckptstore's ``auto`` (planes for floats,
   ckptstore/format/planes.py; raw where it saves < 3%), ZipNN (threads=1, its version printed) and blosc2
   (shuffle + zstd-1, nthreads=1) where installed.
2. The whole fp32 state (weights + AdamW) on disk: ckptstore raw / zstd-1 / auto, DCP (``dcp.save`` with
   ``FileSystemWriter``) and DCP with its ``ZStandard`` stream extension where torch has it.
3. A blocking ``Store.save`` of the fp32 state + bf16 weights with ``codec="auto"`` against ``codec="raw"`` (and
   zstd-1), fresh store each run, contenders alternated (benchmarks/harness.py); ``x raw`` is the ratio.
"""
from __future__ import annotations

import glob
import importlib.metadata as md
import sys
import time

import harness as H  # noqa: E402  (puts the checkout on sys.path)
import common as C  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def train(steps: int, seed: int):
    """The GPT + AdamW after ``steps`` steps of byte-level language modelling on this repository's source."""
    torch.manual_seed(seed)
    text = b"".join(open(f, "rb").read() for f in sorted(glob.glob(str(C.REPO / "ckptstore/**/*.py"),
                                                                       recursive=True)))
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    model = C.GPT(d_model=256, n_layers=4, vocab=256, n_heads=4)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(seed + 1)
    loss = None
    for _ in range(steps):
        ix = torch.randint(0, len(data) - 65, (8,), generator=g).tolist()
        x = torch.stack([data[i:i + 65] for i in ix])
        loss = F.cross_entropy(model(x[:, :-1]).reshape(-1, 256), x[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt, float(loss.detach())


def tensor_classes(model, opt):
    params = [p.detach() for p in model.parameters()]
    state = [opt.state[p] for p in model.parameters()]
    return {"fp32 weights": params, "Adam m": [s["exp_avg"] for s in state],
            "Adam v": [s["exp_avg_sq"] for s in state], "bf16 weights": [p.to(torch.bfloat16) for p in params]}


def codecs():
    """name -> (encode(raw bytes, dtype) -> stored, decode(stored, raw length, dtype) -> bytes)."""
    import zstandard
    from ckptstore.format import blobs, planes

    def zstd(level):
        return (lambda b, dt: zstandard.ZstdCompressor(level=level).compress(b),
                lambda s, n, dt: zstandard.ZstdDecompressor().decompress(s))

    def auto_enc(b, dt):
        used, payload = blobs.encode_chunk(b, "auto", 1, planes.float_itemsize(str(dt).split(".")[-1]))
        return used, payload

    def auto_dec(s, n, dt):
        used, payload = s
        if used == "raw":
            return payload
        out = bytearray(n)
        blobs.decode_into(used, payload, memoryview(out))
        return out
    out = {"zstd-1": zstd(1), "zstd-3": zstd(3), "ckptstore auto": (auto_enc, auto_dec)}
    try:
        import zipnn
        names = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
        out[f"ZipNN {md.version('zipnn')}"] = (
            lambda b, dt: zipnn.ZipNN(input_format="byte", bytearray_dtype=names[dt], threads=1).compress(bytearray(b)),
            lambda s, n, dt: zipnn.ZipNN(input_format="byte", bytearray_dtype=names[dt], threads=1).decompress(s))
    except ImportError:
        pass
    try:
        import blosc2
        out[f"blosc2 {blosc2.__version__} shuffle+zstd-1"] = (
            lambda b, dt: blosc2.compress2(b, codec=blosc2.Codec.ZSTD, clevel=1, typesize=dt.itemsize, nthreads=1,
                                           filters=[blosc2.Filter.SHUFFLE], splitmode=blosc2.SplitMode.ALWAYS_SPLIT),
            lambda s, n, dt: blosc2.decompress2(s, nthreads=1))
    except ImportError:
        pass
    return out


def stored_len(s) -> int:
    return len(s[1]) if isinstance(s, tuple) else len(s)


def cpu(f, repeat):
    best, out = None, None
    for _ in range(repeat):
        t0 = time.process_time()
        out = f()
        dt = time.process_time() - t0
        best = dt if best is None else min(best, dt)
    return best, out


def codec_table(classes, repeat):
    rows = []
    for cname, tensors in classes.items():
        raws = [C.as_bytes(t).numpy().tobytes() for t in tensors]
        dtype = tensors[0].dtype
        total = sum(map(len, raws))
        rows.append((cname, "raw", 1.0, "", "", "ok"))
        for name, (enc, dec) in codecs().items():
            try:
                ce, stored = cpu(lambda: [enc(b, dtype) for b in raws], repeat)
                cd, back = cpu(lambda: [dec(s, len(b), dtype) for s, b in zip(stored, raws)], repeat)
                ok = all(bytes(x) == b for x, b in zip(back, raws))
                rows.append((cname, name, total / sum(map(stored_len, stored)), f"{total / ce / 1e9:.2f}",
                             f"{total / cd / 1e9:.2f}", "ok" if ok else "WRONG DATA"))
            except Exception as e:                       # noqa: BLE001 (a contender that fails is a row, not a stop)
                rows.append((cname, name, float("nan"), "", "", f"n/a: {e}"))
        yield total, rows
        rows = []


def disk_sizes(model, opt, base):
    """Bytes on disk of the fp32 state (weights + AdamW) saved by ckptstore (raw, zstd-1, auto) and DCP."""
    import torch.distributed.checkpoint as dcp
    from ckptstore import Store, Writing
    sizes = {}
    for codec in ("raw", "zstd", "auto"):
        d = C.fresh_dir(base, f"codec_disk_{codec}_")
        with Store(d, writing=Writing(codec=codec)) as s:
            s.save({"model": model, "optimizer": opt}, 1)
        sizes[f"ckptstore {codec}"] = sum(C.disk_bytes(d / sub) for sub in ("objects", "packs") if (d / sub).exists())
        C.rmtree(d)
    sd = {"model": model.state_dict(), "optim": opt.state_dict()}
    d = C.fresh_dir(base, "codec_dcp_")
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(d)))
    sizes["DCP"] = C.disk_bytes(d)
    C.rmtree(d)
    try:
        from torch.distributed.checkpoint._extension import ZStandard
        d = C.fresh_dir(base, "codec_dcpz_")
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(d), _extensions=[ZStandard()]))
        sizes["DCP + ZStandard extension"] = C.disk_bytes(d)
        C.rmtree(d)
    except ImportError as e:
        sizes[f"DCP + ZStandard: n/a ({e})"] = 0
    return sizes


def save_contender(state, codec, base) -> H.Contender:
    label = f"save, {codec}"

    def run(res: H.Results, d) -> None:
        from ckptstore import Store, Writing
        with Store(d, writing=Writing(codec=codec)) as s:
            with res.timed(label) as m:
                r = s.save(state, 1)
            m["bytes"] = r.bytes_written
    return H.Contender(label, run, records=True, rows=(label,), setup=lambda: C.fresh_dir(base, f"codec_{codec}_"),
                       teardown=C.rmtree)


def codec_sections(model, opt, classes, args, base):
    """Sections 1 and 2: the codec table per tensor class, and the sizes on disk against DCP."""
    out_rows = []
    print(f"\n1. per tensor class (ratio = raw / stored; GB/s of raw bytes per core, CPU time, best of {args.repeat})")
    print(f"{'class':<14} {'codec':<32} {'ratio':>6} {'comp GB/s':>9} {'dec GB/s':>9}  check")
    for total, rows in codec_table(classes, args.repeat):
        for cname, name, ratio, ce, cd, ok in rows:
            print(f"{cname:<14} {name:<32} {ratio:>6.3f} {ce:>9} {cd:>9}  {ok}")
            out_rows.append(dict(cls=cname, codec=name, ratio=ratio, compress=ce, decompress=cd, check=ok,
                                 raw_bytes=total))
    print("\n2. the fp32 state (weights + AdamW) on disk")
    sizes = disk_sizes(model, opt, base)
    raw = sizes["ckptstore raw"]
    for k, v in sizes.items():
        print(f"   {k:<32} {v / 1e6:8.2f} MB" + (f"   x{raw / v:.3f} smaller than raw" if v else ""))
    return out_rows, sizes


def main() -> int:
    ap = H.parser(__doc__, repeat=3)
    ap.add_argument("--steps", type=int, default=300, help="AdamW steps before the state is taken")
    ap.add_argument("--save-only", action="store_true", help="only section 3 (the blocking saves)")
    args = ap.parse_args()
    base = H.scratch_dir(args.dir)
    print(H.banner(steps=args.steps, dir=base))
    t0 = time.perf_counter()
    model, opt, loss = train(args.steps, args.seed)
    print(f"trained {args.steps} steps in {time.perf_counter() - t0:.0f} s (loss {loss:.2f}), "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters")
    classes = tensor_classes(model, opt)
    out_rows, sizes = [], {}
    if not args.save_only:
        out_rows, sizes = codec_sections(model, opt, classes, args, base)
    print("\n3. blocking Store.save, fp32 state + bf16 weights")
    state = {"model": model, "optimizer": opt, "bf16": {f"p{i}": t for i, t in enumerate(classes["bf16 weights"])}}
    res = H.compare([save_contender(state, c, base) for c in ("raw", "zstd", "auto")], args.repeat)
    total = sum(C.nbytes(t) for t in C.state_tensors(model, opt)) + sum(C.nbytes(t) for t in classes["bf16 weights"])
    print(res.table(ratios={"x raw": lambda r: "save, raw"}, fmt="{:.3f}",
                    columns=[("written/raw", lambda r: f"{r.median('bytes') / total:.3f}")]))
    H.write_json(args.json, args, codecs=out_rows, disk=sizes, rows=res.to_json({"x raw": lambda r: "save, raw"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
