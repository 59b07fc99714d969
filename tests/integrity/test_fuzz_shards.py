"""Fuzzing format 2's sharded steps (issue 17, section 3): a 2-rank FSDP2 + AdamW step (gloo, 127.0.0.1) whose
manifests are mutated structurally (DTensor shard offsets, shapes, global shapes, dtypes, placements, nodes
dropped or duplicated, manifest generations) and re-framed with valid checksums and digests, or whose shard map
is damaged, then loaded on one process (the resharding read path: every saved shard is untrusted input).

A case fails if anything but a ``CheckpointError`` escapes, or if ``load`` returns anything but the untouched
step's exact values (a gap filled with uninitialised memory, a shard read at the wrong place). Seeded, bounded:
``CKPTSTORE_FUZZ_SHARD_CASES`` cases (default 120)."""
import copy
import os
import random
import shutil

import pytest
import torch

from ckptstore import CheckpointError, Store
from helpers import rewrite_frame, rewrite_manifest, step_dir

CASES = int(os.environ.get("CKPTSTORE_FUZZ_SHARD_CASES", "120"))


@pytest.fixture
def template(fsdp_two_rank_store):
    root = fsdp_two_rank_store
    with Store(root, rank=0, world_size=1) as s:
        step = s.steps()[-1]
        expected = s.load(step)
    return root, step, expected


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _dtensor_nodes(body):
    return [n for n in body["nodes"] if n[1] == "dtensor"]


def mutate_manifest(rng: random.Random, body) -> str:
    nodes = _dtensor_nodes(body)
    n = rng.choice(nodes)
    e = n[2]
    dim = rng.randrange(len(e["shape"]))
    k = rng.choice([1, 2, 3, -1, -2, 5, 10 ** 6, -(10 ** 6)])
    what = rng.choice(["offset", "shape", "global_shape", "dtype", "placements", "mesh", "drop", "dup",
                       "swap_offsets", "offset_and_shape"])
    if what == "offset":
        e["shard"]["offset"][dim] += k
    elif what == "shape":
        e["shape"][dim] += k
    elif what == "global_shape":
        e["shard"]["global_shape"][dim] += k
    elif what == "dtype":
        e["dtype"] = rng.choice(["float64", "float16", "bfloat16", "int32", "uint8"])
    elif what == "placements":
        e["shard"]["placements"] = rng.choice([["R"], ["S(1)"], ["S(7)"], ["P(sum)"], ["junk"], []])
    elif what == "mesh":
        e["shard"]["mesh"] = rng.choice([[1], [4], [2, 2], [0], []])
    elif what == "drop":
        body["nodes"].remove(n)
    elif what == "dup":
        body["nodes"].append(copy.deepcopy(n))
    elif what == "swap_offsets":
        other = rng.choice(nodes)
        e["shard"]["offset"], other[2]["shard"]["offset"] = other[2]["shard"]["offset"], e["shard"]["offset"]
    else:                                               # move and resize consistently: same bytes, other box
        e["shard"]["offset"][dim] = max(0, e["shard"]["offset"][dim] + k)
    return f"{what} {'/'.join(map(str, n[0]))} dim {dim} by {k}"


def damage_shard_map(rng: random.Random, root, step) -> str:
    sd = step_dir(root, step)
    maps = sorted(p for p in sd.iterdir() if p.name.startswith("shards"))
    if not maps:
        return "no shard map"
    p = maps[0]
    data = bytearray(p.read_bytes())
    how = rng.choice(["flip", "truncate", "remove"])
    if how == "flip":
        i = rng.randrange(len(data))
        data[i] ^= 1 << rng.randrange(8)
        p.write_bytes(bytes(data))
    elif how == "truncate":
        p.write_bytes(bytes(data[: rng.randrange(len(data))]))
    else:
        p.unlink()
    return f"shard map {how}"


def claim_generation(rng: random.Random, root, step) -> str:
    """Rank r's manifest renamed to generation g and the commit marker saying so (valid), or saying another."""
    r = rng.randrange(2)
    g = rng.choice([1, 7])
    sd = step_dir(root, step)
    (sd / f"manifest-rank{r:05d}.msgpack").rename(sd / f"manifest-rank{r:05d}.g{g}.msgpack")
    claimed = g if rng.random() < 0.5 else rng.choice([0, g + 1, 10 ** 9 - 1])

    def claim(body):
        for ref in body["manifests"]:
            if ref[0] == r:
                ref[3:] = [claimed]
    rewrite_frame(sd / "COMMIT", claim)
    return f"rank {r} manifest at generation {g}, marker claims {claimed}"


def test_fuzz_sharded_steps_load_exactly_or_raise_checkpoint_errors(template, tmp_path):
    src, step, expected = template
    rng = random.Random(int(os.environ.get("CKPTSTORE_FUZZ_SEED", "17")))
    failures, refused, loaded = [], 0, 0
    for case in range(CASES):
        root = tmp_path / f"c{case}"
        shutil.copytree(src, root)
        kind = rng.random()
        if kind < 0.75:
            rank = rng.randrange(2)
            desc = []
            rewrite_manifest(root, step, lambda b: desc.append(mutate_manifest(rng, b)), rank=rank)
            what = f"rank {rank}: {desc[0]}"
        elif kind < 0.9:
            what = damage_shard_map(rng, root, step)
        else:
            what = claim_generation(rng, root, step)
        try:
            with Store(root, rank=0, world_size=1) as s:
                got = s.load(step)
            if _equal(got, expected):
                loaded += 1
            else:
                failures.append(f"case {case} ({what}): loaded values that differ from the step's")
        except CheckpointError:
            refused += 1
        except Exception as e:          # noqa: BLE001 - the point of the test
            failures.append(f"case {case} ({what}): {type(e).__name__}: {e}")
        shutil.rmtree(root, ignore_errors=True)
    assert refused and loaded, f"the mutations did not exercise both outcomes: {refused} refused, {loaded} loaded"
    assert not failures, f"{len(failures)} of {CASES} cases failed:\n" + "\n".join(failures[:30])
