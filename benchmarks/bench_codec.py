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
   (shuffle + zstd-1, nthreads=1) where installed. Every decoder writes into a new buffer per tensor, as they
   all return one; the row ``ckptstore auto, kept buffers`` decodes into buffers kept from repeat to
   repeat, the codec's own speed: a new buffer's page faults cost ~2 us a 4 KiB page on this VM, as much as the
   decoding (a resume decodes into the buffer it reads raw chunks into, and pays them either way).
2. The whole fp32 state (weights + AdamW) on disk: ckptstore raw / zstd-1 / auto, DCP (``dcp.save`` with
   ``FileSystemWriter``) and DCP with its ``ZStandard`` stream extension where torch has it.
3. A blocking ``Store.save`` of the fp32 state + bf16 weights with ``codec="auto"`` against ``codec="raw"`` (and
   zstd-1), fresh store each run, contenders alternated (benchmarks/harness.py); ``x raw`` is the ratio. Twice:
   with the default ``Packing`` (this model's tensors are all under 4 MiB: packs, encoded by the pool and streamed
   to disk), and with ``Packing(threshold=64 KiB)`` (``, blobs``: each tensor a blob, as a large model's are).
4. The delta codec (``Writing(codec="auto", deltas=K)``, ckptstore/format/delta.py): training goes on from the
   state of 1., a save every ``--delta-every`` training steps (default 1), ``--delta-saves`` saves (default 8).
   Per class: raw / stored of the full chunks (planes) and of the delta against the chunk ``d`` saves back
   (d = 1: consecutive saved steps), as the writer keeps it (the smaller of delta and full), and averaged over a
   cycle of one key and K deltas (what a run stores per save with ``deltas=K``). Then the blocking ``Store.save``
   of the next saved step after the first (same open store, alternated, ``--repeat`` runs): raw, ``auto``,
   ``auto`` + ``deltas=4``, with ``Packing(threshold=64 KiB)`` so that this small model's tensors are blobs (as a
   large model's are at the default 4 MiB: only blobs become deltas).
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
    kept = {}

    def auto_dec_kept(s, n, dt):                     # into a buffer kept from repeat to repeat: no page faults
        used, payload = s
        if used == "raw":
            return payload
        out = kept.get(id(payload))
        if out is None:
            out = kept[id(payload)] = bytearray(n)
        blobs.decode_into(used, payload, memoryview(out))
        return out
    out = {"zstd-1": zstd(1), "zstd-3": zstd(3), "ckptstore auto": (auto_enc, auto_dec),
           "ckptstore auto, kept buffers": (auto_enc, auto_dec_kept)}
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


def save_contender(state, codec, base, blobs: bool = False) -> H.Contender:
    label = f"save, {codec}" + (", blobs" if blobs else "")

    def run(res: H.Results, d) -> None:
        from ckptstore import Packing, Store, Writing
        packing = Packing(threshold=64 << 10) if blobs else Packing()
        with Store(d, writing=Writing(codec=codec, packing=packing)) as s:
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


def delta_save_contender(first, second, label, writing, base) -> H.Contender:
    """A blocking save of ``second`` into a store holding ``first`` (saved in the setup, not timed)."""
    from ckptstore import Store

    def setup():
        d = C.fresh_dir(base, "codec_delta_")
        s = Store(d, writing=writing)
        s.save(first, 1)
        return d, s

    def run(res: H.Results, ctx) -> None:
        with res.timed(label) as m:
            r = ctx[1].save(second, 2)
        m["bytes"], m["raw"] = r.bytes_written, r.bytes_total

    def teardown(ctx):
        ctx[1].close()
        C.rmtree(ctx[0])
    return H.Contender(label, run, records=True, rows=(label,), setup=setup, teardown=teardown)


def delta_section(model, opt, args, base):
    """Section 4: delta ratios against distance, per class, and the save of a next step (module docstring)."""
    import copy
    from ckptstore import Packing, Writing

    def state():
        bf16 = {f"p{i}": p.detach().to(torch.bfloat16) for i, p in enumerate(model.parameters())}
        return copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict(), "bf16": bf16})
    first, second = state(), None
    from ckptstore.format import delta, planes
    text = b"".join(open(f, "rb").read() for f in sorted(glob.glob(str(C.REPO / "ckptstore/**/*.py"),
                                                                       recursive=True)))
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    g = torch.Generator().manual_seed(args.seed + 2)

    def snap():
        return {k: [C.as_bytes(t).numpy().tobytes() for t in v] for k, v in tensor_classes(model, opt).items()}
    snaps = [snap()]
    for _ in range(args.delta_saves):
        for _ in range(args.delta_every):
            ix = torch.randint(0, len(data) - 65, (8,), generator=g).tolist()
            x = torch.stack([data[i:i + 65] for i in ix])
            F.cross_entropy(model(x[:, :-1]).reshape(-1, 256), x[:, 1:].reshape(-1)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        snaps.append(snap())
        second = second or state()
    sizes = {"fp32 weights": 4, "Adam m": 4, "Adam v": 4, "bf16 weights": 2}
    every = list(range(1, args.delta_saves + 1))
    dists = [d for d in (1, 2, 3, 4, 6, 8) if d <= args.delta_saves]
    print(f"\n4. deltas: a save every {args.delta_every} training step(s); raw / stored; d = saves between the "
          "chunk and its key; 'kept' = the smaller of delta and full per tensor; 'K=k' = over one key + k deltas")
    print(f"{'class':<14} {'full':>6} " + " ".join(f"{'d=' + str(d):>6}" for d in dists) + "  "
          + " ".join(f"{'kept d=' + str(d):>9}" for d in dists) + "  " + " ".join(f"{'K=' + str(k):>6}" for k in dists)
          + "  comp/dec GB/s (d=1, CPU, one core)")
    rows = []
    for cname, k in sizes.items():
        raw = sum(len(b) for b in snaps[0][cname])
        full = [len(planes.encode(b, k)) for b in snaps[0][cname]]
        dl, kept = {}, {}
        for d in every:
            frames = [len(delta.encode(b, key, "00" * 32, k)) for b, key in zip(snaps[d][cname], snaps[0][cname])]
            dl[d] = raw / sum(frames)
            kept[d] = raw / sum(min(f, u) for f, u in zip(frames, full))
        cycle = {K: (K + 1) * raw / (sum(full) + sum(raw / kept[d] for d in range(1, K + 1))) for K in dists}
        pairs = list(zip(snaps[1][cname], snaps[0][cname]))
        ce, coded = cpu(lambda: [delta.encode(b, key, "00" * 32, k) for b, key in pairs], args.repeat)

        def dec():
            outs = [bytearray(len(b)) for b, _ in pairs]
            for f, (b, key), o in zip(coded, pairs, outs):
                delta.decode_into(f, key, "00" * 32, memoryview(o))
            return outs
        cd, back = cpu(dec, args.repeat)
        assert all(bytes(o) == b for o, (b, _) in zip(back, pairs)), "delta round trip"
        print(f"{cname:<14} {raw / sum(full):>6.3f} " + " ".join(f"{dl[d]:>6.3f}" for d in dists) + "  "
              + " ".join(f"{kept[d]:>9.3f}" for d in dists) + "  "
              + " ".join(f"{cycle[K]:>6.3f}" for K in dists) + f"  {raw / ce / 1e9:.2f} / {raw / cd / 1e9:.2f}")
        rows.append(dict(cls=cname, full=raw / sum(full), delta={d: dl[d] for d in dists},
                         kept={d: kept[d] for d in dists}, cycle=cycle, compress=raw / ce, decompress=raw / cd))
    print(f"\n   blocking save of the next saved step (Packing(threshold=64 KiB))")
    blobs = Packing(threshold=64 << 10)
    res = H.compare([delta_save_contender(first, second, label, w, base) for label, w in (
        ("next save, raw", Writing(packing=blobs)), ("next save, auto", Writing(codec="auto", packing=blobs)),
        ("next save, auto deltas=4", Writing(codec="auto", deltas=4, packing=blobs)))], args.repeat)
    print(res.table(ratios={"x raw": lambda r: "next save, raw"}, fmt="{:.3f}",
                    columns=[("raw/written", lambda r: f"{r.median('raw') / r.median('bytes'):.3f}")]))
    return rows, res.to_json({"x raw": lambda r: "next save, raw"})


def main() -> int:
    ap = H.parser(__doc__, repeat=3)
    ap.add_argument("--steps", type=int, default=300, help="AdamW steps before the state is taken")
    ap.add_argument("--save-only", action="store_true", help="only section 3 (the blocking saves)")
    ap.add_argument("--delta-only", action="store_true", help="only section 4 (the delta codec)")
    ap.add_argument("--delta-every", type=int, default=1, help="training steps between two saves (section 4)")
    ap.add_argument("--delta-saves", type=int, default=8, help="saves after the first (section 4)")
    args = ap.parse_args()
    base = H.scratch_dir(args.dir)
    print(H.banner(steps=args.steps, dir=base))
    t0 = time.perf_counter()
    model, opt, loss = train(args.steps, args.seed)
    print(f"trained {args.steps} steps in {time.perf_counter() - t0:.0f} s (loss {loss:.2f}), "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters")
    classes = tensor_classes(model, opt)
    out_rows, sizes = [], {}
    if args.delta_only:
        rows, saves = delta_section(model, opt, args, base)
        H.write_json(args.json, args, deltas=rows, delta_saves=saves)
        return 0
    if not args.save_only:
        out_rows, sizes = codec_sections(model, opt, classes, args, base)
    print("\n3. blocking Store.save, fp32 state + bf16 weights")
    state = {"model": model, "optimizer": opt, "bf16": {f"p{i}": t for i, t in enumerate(classes["bf16 weights"])}}
    res = H.compare([save_contender(state, c, base, blobs) for blobs in (False, True)
                     for c in ("raw", "zstd", "auto")], args.repeat)
    total = sum(C.nbytes(t) for t in C.state_tensors(model, opt)) + sum(C.nbytes(t) for t in classes["bf16 weights"])
    anchor = {"x raw": lambda r: "save, raw" + (", blobs" if r.name.endswith("blobs") else "")}
    print(res.table(ratios=anchor, fmt="{:.3f}",
                    columns=[("written/raw", lambda r: f"{r.median('bytes') / total:.3f}")]))
    deltas, saves = delta_section(model, opt, args, base) if not args.save_only else ([], [])
    H.write_json(args.json, args, codecs=out_rows, disk=sizes, rows=res.to_json(anchor),
                 deltas=deltas, delta_saves=saves)
    return 0


if __name__ == "__main__":
    sys.exit(main())
