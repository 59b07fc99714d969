"""The shard map is a hint (issue 26, item 8; FORMAT.md "Shard map"): whatever is wrong with it, a step whose
manifests and commit marker are whole loads bit for bit (the reader logs the fallback and reads every manifest),
in both forms of the map (described by rule, and the older one box per rank and key, ``"boxes"``, written here
through the format's own frame encoder since the writer no longer writes it). A damaged manifest (the truth)
still fails its step, and resume still falls back to the older one.

The step is step 2 of ``fsdp_two_rank_store`` (2-rank FSDP2 + AdamW, gloo on 127.0.0.1), loaded in one process:
a changed world size, the path that consults the map."""
import logging
import shutil

import pytest

from ckptstore import CorruptCheckpointError, Store
from ckptstore.format.blobs import digest_bytes
from ckptstore.format.layout import shards_path
from ckptstore.format.manifest import frame, unframe
from ckptstore.format.shardmap import key_hash
from helpers import bits_equal, rewrite_frame, rewrite_manifest, step_dir

STEP = 2
FALLBACK = "reading every"          # both fallback messages: unusable map, ranks that do not cover


@pytest.fixture(scope="module")
def saved(fsdp_two_rank_store):
    """(store, the step's values as loaded on one process, its map's body, every rank's manifest)."""
    with Store(fsdp_two_rank_store, rank=0, world_size=1) as s:
        assert s.steps() == [1, STEP]
        commit = s.catalog.read_commit(STEP)
        body = unframe(s.storage.read_bytes(shards_path(STEP, commit.shards[2])), "shards", what="map")[0]
        manifests = [s.catalog.read_manifest(commit, r) for r in range(2)]
        return fsdp_two_rank_store, s.load(STEP), body, manifests


def _write_map(root, data: bytes) -> None:
    """Replace the step's map with ``data`` and record its digest and size in the commit marker: only the map's
    own content stands between the damage and the reader."""
    (path,) = [p for p in step_dir(root, STEP).iterdir() if p.name.startswith("shards")]
    path.write_bytes(data)

    def fix(body):
        body["shards"][0], body["shards"][1] = bytes.fromhex(digest_bytes(data)), len(data)
    rewrite_frame(step_dir(root, STEP) / "COMMIT", fix)


def _boxes(manifests):
    """The older form's boxes, from the manifests: key hash -> [[rank, offset, shape], ...]."""
    out = {}
    for m in manifests:
        for n in m.nodes:
            if n.kind == "dtensor":
                out.setdefault(key_hash(n.path), []).append([m.rank, list(n.payload.shard.offset),
                                                             list(n.payload.shape)])
    return out


def _rule_map(body, how):
    body = dict(body, keys=[list(k) for k in body["keys"]], meshes=[list(m) for m in body["meshes"]])
    if how == "rule_unknown_hash":                 # a key hash no manifest has, on the step's mesh
        body["keys"].append([b"\x00" * 8, 0, [5], body["keys"][0][3], ["S(0)"]])
    elif how == "rule_key_missing":                # a sharded key the map does not describe
        body["keys"].pop(0)
    elif how == "rule_wrong_placements":
        for k in body["keys"]:
            k[4] = ["R"] * len(k[4])
    elif how == "rule_wrong_global_shape":
        body["keys"][0][2] = [body["keys"][0][2][0] + 2] + body["keys"][0][2][1:]
    elif how == "rule_wrong_grid":                 # the mesh's ranks swapped: every box at the other rank
        import numpy as np
        shape, grid = body["meshes"][0]
        if grid is None:                           # nil: 0..n-1 in mesh order (issue 29)
            grid = np.arange(int(np.prod(shape)), dtype="<i4").tobytes()
        body["meshes"][0][1] = np.frombuffer(grid, "<i4")[::-1].astype("<i4").tobytes()
    elif how == "rule_wrong_schema":
        body["meshes"] = {"not": "a list"}
    return frame("shards", body)


def _boxes_map(body, manifests, how):
    boxes = _boxes(manifests)
    first = next(iter(boxes))
    if how == "boxes_unknown_hash":                # a key hash no manifest has, with boxes of both ranks
        boxes[b"\x00" * 8] = [[0, [0], [3]], [1, [3], [3]]]
    elif how == "boxes_key_without_boxes":
        boxes[first] = []
    elif how == "boxes_not_covering":              # rank 1's box of a key lost: rank 0's alone do not cover
        boxes[first] = [b for b in boxes[first] if b[0] == 0]
    elif how == "boxes_wrong_box":
        boxes[first] = [[r, [o[0] + 1] + o[1:], s] for r, o, s in boxes[first]]
    return frame("shards", {"step": STEP, "world_size": 2, "boxes": list(boxes.items()),
                            "rank_local": body["rank_local"]})


DAMAGE = ["undecodable", "not_a_map_frame", "zstd_length_lies", "zstd_not_zstd", "rule_unknown_hash", "rule_key_missing", "rule_wrong_placements",
          "rule_wrong_global_shape", "rule_wrong_grid", "rule_wrong_schema", "boxes_unknown_hash",
          "boxes_key_without_boxes", "boxes_not_covering", "boxes_wrong_box"]


def _damaged_map(body, manifests, how) -> bytes:
    if how == "undecodable":
        return b"\xc1 not msgpack at all"
    if how == "not_a_map_frame":                   # a well-formed frame of another kind
        return frame("commit", {"step": STEP})
    if how.startswith("zstd_"):                    # format 3's compressed body, checksum valid as stored
        import msgpack
        from ckptstore.format.manifest import SHARDS_FORMAT
        outer = msgpack.unpackb(frame("shards", body, SHARDS_FORMAT, compress=True), raw=False)
        if how == "zstd_length_lies":
            outer["zstd"] += 1
        else:
            outer["body"] = b"\x28\xb5\x2f\xfd not a zstd frame" + outer["body"][20:]
            outer["blake3"] = bytes.fromhex(digest_bytes(outer["body"]))
        return msgpack.packb(outer, use_bin_type=True)
    if how.startswith("rule_"):
        return _rule_map(body, how)
    return _boxes_map(body, manifests, how)


@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_shard_map_loads_the_step_from_every_manifest(saved, tmp_path, caplog, how):
    src, expected, body, manifests = saved
    root = tmp_path / "store"
    shutil.copytree(src, root)
    _write_map(root, _damaged_map(body, manifests, how))
    with caplog.at_level(logging.WARNING, logger="ckptstore"), Store(root, rank=0, world_size=1) as s:
        assert bits_equal(s.load(STEP), expected)
        assert f"step {STEP}" in caplog.text and FALLBACK in caplog.text, caplog.text
        caplog.clear()
        state = {"app": None, "step": None}
        assert s.resume(state) == STEP and state["step"] == STEP
        assert s.resumed_from["manifests_read"] == 2
        assert bits_equal(state["app"], expected["app"])
        assert FALLBACK in caplog.text


@pytest.mark.parametrize("how", ["boxes_intact", "rule_intact", "rule_format2"])
def test_an_intact_map_of_either_form_is_used_without_a_fallback(saved, tmp_path, caplog, how):
    """Either form, and the rule form as written before format 3 (an uncompressed body), is read and used."""
    src, expected, body, manifests = saved
    root = tmp_path / "store"
    shutil.copytree(src, root)
    if how == "boxes_intact":
        _write_map(root, _boxes_map(body, manifests, how))
    elif how == "rule_format2":
        _write_map(root, frame("shards", body))
    with caplog.at_level(logging.WARNING, logger="ckptstore"), Store(root, rank=0, world_size=1) as s:
        assert bits_equal(s.load(STEP), expected)
    assert FALLBACK not in caplog.text and "shard map" not in caplog.text, caplog.text


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("map_state", ["intact", "rule_unknown_hash", "boxes_key_without_boxes"])
def test_a_manifest_that_lost_a_sharded_key_still_fails_its_step(saved, tmp_path, rank, map_state):
    """The truth is damaged (one rank's manifest lost a DTensor node, re-framed with a valid digest): the step
    is a CorruptCheckpointError whether the map vouches for the manifest, is damaged too, or is of the older
    form; resume takes step 1."""
    src, _, body, manifests = saved
    root = tmp_path / "store"
    shutil.copytree(src, root)
    if map_state != "intact":
        _write_map(root, _damaged_map(body, manifests, map_state))

    def drop(b):
        b["nodes"].remove(next(n for n in b["nodes"] if n[1] == "dtensor"))
    rewrite_manifest(root, STEP, drop, rank=rank)
    with Store(root, rank=0, world_size=1) as s:
        with pytest.raises(CorruptCheckpointError, match="sharded keys|shards of|cover"):
            s.load(STEP)
        state = {"app": None, "step": None}
        assert s.resume(state) == 1 and state["step"] == 1
