"""The manifest table (issue 29, FORMAT.md "Manifest table"): a commit marker of more than ``INLINE_ROWS`` ranks
names a table of fixed rows read page by page; smaller markers are written as before. Real stores on disk; the
table is forced at one rank by lowering ``mtable.INLINE_ROWS`` (the multi-process cases are in
tests/distributed/test_distributed.py and test_agreement_scale.py)."""
import msgpack
import pytest
import torch

from ckptstore import Store
from ckptstore.format import manifest as manifest_mod, mtable
from ckptstore.format.manifest import Commit, decode_commit, encode_commit, encode_commit_files
from ckptstore.util.errors import CorruptCheckpointError, IncompatibleCheckpointError
from helpers import flip_byte, step_dir
from simranks import MemRoot


def rows(n):
    return {r: (bytes([r % 251]) * 32, 100 + r, r % 3) for r in range(n)}


def commit(n):
    return Commit(step=9, world_size=n, manifests=rows(n), created=1.7e9, bytes_total=1, run_id="r")


def test_a_marker_of_at_most_inline_rows_ranks_is_written_as_before():
    data, table = encode_commit_files(commit(mtable.INLINE_ROWS))
    outer = msgpack.unpackb(data, raw=False)
    assert table is None and outer["format"] == 2
    assert len(msgpack.unpackb(outer["body"], raw=False)["manifests"]) == mtable.INLINE_ROWS
    assert decode_commit(data, step=9, what="COMMIT").manifests == rows(mtable.INLINE_ROWS)


def test_a_reader_of_one_row_reads_one_page_and_checks_it():
    n = 5 * mtable.ROWS_PER_PAGE + 7
    assert n > mtable.INLINE_ROWS
    data, table = encode_commit_files(commit(n))
    pages = 6
    assert len(table) == n * mtable.ROW.size + 32 * pages and len(data) < 1024     # 41 B a rank inline: 27 KB
    got = decode_commit(data, step=9, what="COMMIT")
    root = MemRoot({mtable.table_path(9, got.table.digest): table})
    got.manifests.bind(root)
    assert len(got.manifests) == n and 5 in got.manifests and n not in got.manifests and root.bytes_read == 0
    assert got.manifests[n - 1] == rows(n)[n - 1]
    assert root.bytes_read == 32 * pages + 7 * mtable.ROW.size      # the index, the last (short) page only
    assert got.manifests[0] == rows(n)[0] and got.manifests[1] == rows(n)[1]
    assert root.bytes_read == 32 * pages + (7 + mtable.ROWS_PER_PAGE) * mtable.ROW.size
    assert dict(got.manifests.items()) == rows(n)                              # tools read every page
    bad = bytearray(table)
    bad[mtable.ROWS_PER_PAGE * mtable.ROW.size + 3] ^= 1                      # page 1
    again = decode_commit(data, step=9, what="COMMIT")
    again.manifests.bind(MemRoot({mtable.table_path(9, got.table.digest): bytes(bad)}))
    assert again.manifests[0] == rows(n)[0]                                   # page 0 is whole
    with pytest.raises(CorruptCheckpointError, match="page 1 of the manifest table"):
        again.manifests[mtable.ROWS_PER_PAGE]
    bad = bytearray(table)
    bad[-1] ^= 1                                                               # the index
    again = decode_commit(data, step=9, what="COMMIT")
    again.manifests.bind(MemRoot({mtable.table_path(9, got.table.digest): bytes(bad)}))
    with pytest.raises(CorruptCheckpointError, match="the index of the manifest table"):
        again.manifests[0]


def test_a_rows_file_names_its_root_s_rows_and_its_owners_rows_apart(tmp_path):
    """A node-local root's rows file: the rows of the parts it holds (``rows_here``: what its uploader copies)
    and, apart, refs: rows of owner ranks whose parts are elsewhere (found by ``table[r]``, so an uploader can
    confirm an owner's manifest on the remote by its digest), never counted as held. A same-named rows file
    written later (a pull, a rebuild) keeps both; a reader from before refs reads the rows alone."""
    from ckptstore.format.catalog import Catalog
    from ckptstore.storage.local import LocalStorage
    n = 5 * mtable.ROWS_PER_PAGE + 7
    data, _ = encode_commit_files(commit(n))
    digest = decode_commit(data, step=9, what="COMMIT").table.digest
    want = rows(n)
    storage = LocalStorage(str(tmp_path))
    cat = Catalog(storage)
    cat.write_rows(9, digest, {8: want[8], 9: want[9]}, {0: want[0], 200: want[200], 9: want[9]})
    cat.write_rows(9, digest, {8: want[8], 10: want[10]})                   # same name (rank 8): merged
    got = decode_commit(data, step=9, what="COMMIT").manifests.bind(storage)
    assert mtable.rows_here(got) == {r: want[r] for r in (8, 9, 10)}       # refs are not held here
    assert got[200] == want[200] and got[0] == want[0]                     # but found for confirming
    with pytest.raises(CorruptCheckpointError, match="no rows file holds rank 1"):
        got[1]
    path, raw = mtable.encode_rows(9, digest, {8: want[8]}, {0: want[0]})
    assert mtable.decode_rows(raw, 9, digest, n, path) == {8: want[8]}
    body = msgpack.unpackb(msgpack.unpackb(raw, raw=False)["body"], raw=False)
    assert [r[0] for r in body["rows"]] == [8] and [r[0] for r in body["refs"]] == [0]


def test_readers_from_before_the_table_refuse_its_marker_as_too_new(monkeypatch):
    data = encode_commit(commit(mtable.INLINE_ROWS + 1))
    monkeypatch.setattr(manifest_mod, "READ_FORMATS", {})                     # what such a reader checks
    with pytest.raises(IncompatibleCheckpointError, match="format version 3"):
        decode_commit(data, step=9, what="COMMIT")


def test_a_store_resumes_through_the_table_and_a_damaged_page_falls_back(tmp_path, monkeypatch):
    monkeypatch.setattr(mtable, "INLINE_ROWS", 0)
    with Store(tmp_path) as s:
        for step in (1, 2):
            s.save({"w": torch.arange(6.0) + step}, step=step)
    table = next(step_dir(tmp_path, 2).glob("manifests-*.tbl"))
    with Store(tmp_path) as s:
        assert torch.equal(s.load(step=2)["w"], torch.arange(6.0) + 2)
        assert s.verify() == {1: None, 2: None}
    flip_byte(table, 40)
    with Store(tmp_path) as s:
        with pytest.raises(CorruptCheckpointError, match="manifest table"):
            s.load(step=2)
        state = {"w": torch.zeros(6)}
        assert s.resume(state) == 1 and torch.equal(state["w"], torch.arange(6.0) + 1)


def test_gc_keeps_the_table_a_marker_names_and_removes_others(tmp_path, monkeypatch):
    monkeypatch.setattr(mtable, "INLINE_ROWS", 0)
    with Store(tmp_path) as s:
        s.save({"w": torch.arange(6.0)}, step=1)
    d = step_dir(tmp_path, 1)
    named = next(d.glob("manifests-*.tbl"))
    stray = d / "manifests-0123456789abcdef.tbl"                   # a replaced table no marker names
    stray.write_bytes(named.read_bytes())
    with Store(tmp_path) as s:
        report = s.gc(grace_seconds=0)
        assert report.unreadable_steps == []
        assert named.exists() and not stray.exists()
        assert torch.equal(s.load(step=1)["w"], torch.arange(6.0))
