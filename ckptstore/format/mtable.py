"""The manifest table: a commit marker's per-rank rows, out of line and read by range (issue 29).

A commit marker names every rank's manifest (digest, size, generation). Inline that is ~41 bytes a rank: 410 KB
at 10,000 ranks, read whole by every resuming rank and sent whole to every leader. A job of more than
:data:`INLINE_ROWS` ranks therefore writes the rows into a file of its own,
``steps/<step>/manifests-<tag>.tbl`` (:func:`~ckptstore.format.layout.table_path`), of fixed-size rows
(:data:`ROW`: 32-byte manifest digest, u64 size, u32 generation, u32 flags = 1, little-endian; row index =
rank) followed by an *index*, the BLAKE3 digest of each page of rows, and the marker names it as ``"table":
[file digest, size, rows per page, index digest]`` (a marker of constant size whatever N: a leader receives it).
A reader of rank r's row reads the index by range (32 bytes a page, once) and page ``r // rows_per_page`` (6 KiB
at 128 rows a page), and checks each against its digest (a mismatch: ``CorruptCheckpointError`` for that step,
which falls back like any damaged step). Markers of at most :data:`INLINE_ROWS` ranks are written as before,
byte for byte.

A root that holds some ranks' parts but not the table (a leader's node-local root, a pull of one rank's part)
holds *rows files* instead, ``rows-<tag>.r<first rank>.msgpack`` (frame kind ``"rows"``): those ranks' rows and the
table's digest. :class:`ManifestTable` looks a row up in the table first and in the rows files when the table is
not there. See FORMAT.md "Manifest table".
"""
from __future__ import annotations

import os
import struct
from collections.abc import Mapping
from typing import Dict, Iterator, List, Optional, Tuple

from .blobs import digest_bytes, read_verified
from .layout import STEPS, parse_table_name, rows_path, table_path, table_tag
from ..util.errors import CorruptCheckpointError, DamagedRead

#: a marker of more ranks than this holds its manifest rows in a table file instead of inline (read when a marker
#: is encoded). ``CKPTSTORE_INLINE_ROWS`` (environment, read at import) lowers it: tests exercise tables with a
#: few real ranks that way (0: every marker names a table)
INLINE_ROWS = int(os.environ.get("CKPTSTORE_INLINE_ROWS", "512"))
ROWS_PER_PAGE = 128                     # rows of one page: 6 KiB, the unit a reader reads and checks
ROW = struct.Struct("<32sQII")          # digest, size in bytes, generation, flags (1 = present)
TABLE_FORMAT = 3                        # frame format of a marker naming a table, and of a rows file
MAX_ROWS_FILE_BYTES = 1 << 20

Row = Tuple[bytes, int, int]


class TableRef(tuple):
    """``(digest, size, rows_per_page, index)``: the table file's BLAKE3 digest (32 bytes), size in bytes, rows
    per page and the digest of its index (the pages' digests), as the marker records them."""
    __slots__ = ()

    def __new__(cls, digest: bytes, size: int, rows_per_page: int, index: bytes):
        return super().__new__(cls, (digest, size, rows_per_page, index))

    digest = property(lambda self: self[0])
    size = property(lambda self: self[1])
    rows_per_page = property(lambda self: self[2])
    index = property(lambda self: self[3])

    def encode(self) -> list:
        return list(self)


def pages_of(world_size: int, rows_per_page: int) -> int:
    return -(-world_size // rows_per_page)


def _check_row(r: int, row) -> Row:
    digest, size, gen = row
    if not isinstance(digest, bytes) or len(digest) != 32 or not 1 <= int(size) < (1 << 63) \
            or not 0 <= int(gen) < 10**9:
        raise ValueError(f"bad manifest row of rank {r}: {row!r:.80}")
    return digest, int(size), int(gen)


def encode_table(manifests, world_size: int, rows_per_page: int = ROWS_PER_PAGE) -> Tuple[bytes, TableRef]:
    """The table file's bytes for ``manifests`` (rank -> (digest, size, generation), every rank of
    ``world_size``) and the reference the marker records. Raises ``ValueError`` for a missing rank."""
    out = bytearray(ROW.size * world_size)
    for r in range(world_size):
        if r not in manifests:
            raise ValueError(f"the manifest table lacks rank {r}")
        digest, size, gen = _check_row(r, manifests[r])
        ROW.pack_into(out, r * ROW.size, digest, size, gen, 1)
    page = ROW.size * rows_per_page
    index = b"".join(bytes.fromhex(digest_bytes(bytes(out[i:i + page]))) for i in range(0, len(out), page))
    data = bytes(out) + index
    return data, TableRef(bytes.fromhex(digest_bytes(data)), len(data), rows_per_page,
                          bytes.fromhex(digest_bytes(index)))


def decode_ref(raw, world_size: int) -> TableRef:
    """The marker's ``"table"`` field, validated against ``world_size``. Raises ``ValueError``."""
    if not isinstance(raw, list) or len(raw) != 4:
        raise ValueError(f"bad manifest table reference {raw!r:.80}")
    digest, size, per, index = raw
    if isinstance(per, bool) or not isinstance(per, int) or not 1 <= per <= (1 << 20):
        raise ValueError(f"bad rows per page {per!r}")
    if not isinstance(digest, bytes) or len(digest) != 32 or not isinstance(index, bytes) or len(index) != 32:
        raise ValueError("bad manifest table digests")
    if isinstance(size, bool) or size != ROW.size * world_size + 32 * pages_of(world_size, per):
        raise ValueError(f"manifest table of {size!r} bytes for {world_size} ranks at {per} rows a page")
    return TableRef(digest, size, per, index)


def parse_rows(data: bytes, first: int) -> Dict[int, Row]:
    """Rows of consecutive ranks from ``first`` (bytes of the table). Raises ``ValueError``."""
    rows = {}
    for i in range(len(data) // ROW.size):
        digest, size, gen, flags = ROW.unpack_from(data, i * ROW.size)
        if flags != 1:
            raise ValueError(f"manifest row of rank {first + i} is not present (flags {flags})")
        rows[first + i] = _check_row(first + i, (digest, size, gen))
    return rows


def encode_rows(step: int, digest: bytes, rows: Dict[int, Row],
                refs: Optional[Dict[int, Row]] = None) -> Tuple[str, bytes]:
    """A rows file (path, bytes): ``rows`` (rank -> row) of the table named ``digest``, whose parts the root
    holds, and ``refs``: rows of ranks whose parts it does not hold (owners of chunks it holds too: its
    uploader confirms those chunks by the owners' manifests; FORMAT.md "Manifest table")."""
    from .manifest import frame
    body = {"step": step, "table": digest, "rows": [[r, *_check_row(r, rows[r])] for r in sorted(rows)]}
    refs = {r: row for r, row in (refs or {}).items() if r not in rows}
    if refs:
        body["refs"] = [[r, *_check_row(r, refs[r])] for r in sorted(refs)]
    return rows_path(step, digest, min(rows)), frame("rows", body, TABLE_FORMAT)


def decode_rows(data: bytes, step: int, digest: bytes, world_size: int, what: str) -> Dict[int, Row]:
    """A rows file's rows; ``CorruptCheckpointError`` when damaged or naming another table."""
    return decode_rows_file(data, step, digest, world_size, what)[0]


def decode_rows_file(data: bytes, step: int, digest: bytes, world_size: int,
                     what: str) -> Tuple[Dict[int, Row], Dict[int, Row]]:
    """A rows file's rows and refs (see :func:`encode_rows`); ``CorruptCheckpointError`` when damaged or naming
    another table."""
    from .manifest import unframe
    body, _ = unframe(data, "rows", what=what, step=step)
    try:
        if body.get("step") != step or body.get("table") != digest:
            raise ValueError("names another step or table")
        out: Tuple[Dict[int, Row], Dict[int, Row]] = ({}, {})
        for field, got in zip(("rows", "refs"), out):
            for raw in body.get(field) or []:
                if not isinstance(raw, list) or len(raw) != 4 or isinstance(raw[0], bool) \
                        or not isinstance(raw[0], int) or not 0 <= raw[0] < world_size:
                    raise ValueError(f"bad row {raw!r:.80}")
                got[raw[0]] = _check_row(raw[0], raw[1:])
        return out
    except (ValueError, TypeError) as e:
        raise CorruptCheckpointError(f"invalid rows file: {e}", step=step, blob=what) from None


class ManifestTable(Mapping):
    """``Commit.manifests`` of a marker naming a table: rank -> (digest, size, generation), read lazily.

    ``len``, iteration and ``in`` cost nothing (every rank of ``world_size`` has a row); ``table[r]`` reads one
    page of the table (cached) or, where the table is not in the root, the root's rows files; ``items()`` reads
    every page (gc, verify, show, copies of a whole step: rank 0 and tools). :meth:`bind` gives it the storage
    it reads from (the catalog that read the marker does). Raises ``CorruptCheckpointError`` for a page that
    does not match its digest, or a row neither the table nor a rows file holds."""

    def __init__(self, step: int, world_size: int, ref: TableRef):
        self.step, self.world_size, self.ref = step, world_size, ref
        self.storage = None
        self.dir = f"{STEPS}/{step:012d}"
        self._rows: Dict[int, Row] = {}
        self._pages = set()
        self._local: Optional[Dict[int, Row]] = None
        self._refs: Dict[int, Row] = {}
        self._index: Optional[bytes] = None
        self.pages_read = 0                      # pages read from the storage (figures, tests)

    def bind(self, storage, directory: Optional[str] = None) -> "ManifestTable":
        """Read rows from ``storage``, in the step's directory or ``directory`` (a step set aside)."""
        self.storage = storage
        if directory is not None:
            self.dir = directory
        return self

    @property
    def path(self) -> str:
        return f"{self.dir}/{table_path(self.step, self.ref.digest).rsplit('/', 1)[1]}"

    def __len__(self) -> int:
        return self.world_size

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.world_size))

    def __contains__(self, r) -> bool:
        return isinstance(r, int) and not isinstance(r, bool) and 0 <= r < self.world_size

    def __getitem__(self, r) -> Row:
        if r not in self:
            raise KeyError(r)
        row = self._rows.get(r)
        if row is not None:
            return row
        if self.storage is None:
            raise CorruptCheckpointError(f"the manifest table of step {self.step} is not bound to a storage",
                                         step=self.step)
        p = r // self.ref.rows_per_page
        if p not in self._pages:
            try:
                self._read_page(p)
                return self._rows[r]
            except FileNotFoundError:
                pass
        local = self.local_rows()
        if r in local:
            return local[r]
        if r in self._refs:               # an owner's row, for confirming its manifest elsewhere
            return self._refs[r]
        raise CorruptCheckpointError(f"manifest table missing and no rows file holds rank {r}", step=self.step,
                                     blob=self.path)

    def _read_checked(self, offset: int, n: int, want: bytes, what: str) -> bytes:
        """``n`` bytes at ``offset`` of the table, checked against digest ``want``."""
        path = self.path

        def once() -> bytes:
            try:
                data = self.storage.read_range_bytes(path, offset, n)
            except FileNotFoundError:
                raise
            except OSError as e:
                raise CorruptCheckpointError(f"manifest table unreadable ({e.strerror or e})", step=self.step,
                                             blob=path) from None
            got = digest_bytes(data)
            if len(data) != n or got != want.hex():
                raise DamagedRead(f"{what} of the manifest table does not match its commit marker "
                                  f"({len(data)} bytes, expected {n})", got=(len(data), got), step=self.step,
                                  blob=path)
            return data
        return read_verified(self.storage, path, once)

    def _read_page(self, p: int) -> None:
        per, path = self.ref.rows_per_page, self.path
        first = p * per
        if self._index is None:          # the pages' digests, once: 32 bytes a page, after the rows
            self._index = self._read_checked(ROW.size * self.world_size, 32 * pages_of(self.world_size, per),
                                             self.ref.index, "the index")
        n = min(per, self.world_size - first) * ROW.size
        data = self._read_checked(first * ROW.size, n, self._index[32 * p:32 * p + 32], f"page {p}")
        self.pages_read += 1
        try:
            rows = parse_rows(data, first)
        except ValueError as e:
            raise CorruptCheckpointError(f"invalid manifest table: {e}", step=self.step, blob=path) from None
        self._rows.update(rows)
        self._pages.add(p)

    def local_rows(self) -> Dict[int, Row]:
        """The rows the root's rows files hold (read once: they are small and name few ranks); their refs
        (other ranks' rows, not held here) are kept aside for ``table[r]``."""
        if self._local is None:
            local: Dict[int, Row] = {}
            refs: Dict[int, Row] = {}
            tag = table_tag(self.ref.digest)
            sd = self.dir
            for name in sorted(self.storage.listdir(sd)):
                if name.startswith("rows-") and parse_table_name(name) == tag:
                    path = f"{sd}/{name}"
                    try:
                        data = self.storage.read_bytes(path, limit=MAX_ROWS_FILE_BYTES)
                    except FileNotFoundError:
                        continue
                    got, other = decode_rows_file(data, self.step, self.ref.digest, self.world_size, path)
                    local.update(got)
                    refs.update(other)
            self._local = local
            self._refs = {r: row for r, row in refs.items() if r not in local}
        return self._local

    def rows_here(self) -> Dict[int, Row]:
        """Every row when the storage holds the table (all its pages read), else the rows files' rows: what a
        node-local root can say about the parts it holds. ``CorruptCheckpointError`` when it holds neither (a
        deleter then keeps the step's files)."""
        if self.storage is None:
            raise CorruptCheckpointError(f"the manifest table of step {self.step} is not bound to a storage",
                                         step=self.step)
        if self.storage.exists(self.path):
            return {r: self[r] for r in range(self.world_size)}
        local = self.local_rows()
        if not local:                # every root with this marker holds the table or rows files: damage
            raise CorruptCheckpointError("manifest table missing and no rows file names it", step=self.step,
                                         blob=self.path)
        return dict(local)


def rows_here(manifests) -> Dict[int, Row]:
    """``Commit.manifests`` as a plain dict of the rows this root can name: an inline marker's every row; a
    table's every row when the root holds the table, else its rows files' (:meth:`ManifestTable.rows_here`)."""
    if isinstance(manifests, ManifestTable):
        return manifests.rows_here()
    return dict(manifests)


def file_names(commit) -> List[str]:
    """The names (in the step's directory) of the table and rows files ``commit``'s marker names: a table's
    name and the prefix of its rows files' (``rows-<tag>.``); ``[]`` for an inline marker."""
    ref = commit.table
    if ref is None:
        return []
    return [table_path(commit.step, ref.digest).rsplit("/", 1)[1], f"rows-{table_tag(ref.digest)}."]


def names_file(commit, name: str) -> bool:
    """Whether ``name`` (a file in the step's directory) is a table or rows file of ``commit``'s marker."""
    tag = parse_table_name(name)
    return tag is not None and commit.table is not None and tag == table_tag(commit.table.digest)


def write_files(storage, step: int, table: Optional[bytes]) -> None:
    """Write the table file (before the marker naming it), when there is one. Content-named: never replaces a
    table another marker names."""
    if table is not None:
        storage.write_atomic(table_path(step, bytes.fromhex(digest_bytes(table))), table)


def rows_for(manifests, ranks: List[int]) -> Dict[int, Row]:
    return {r: manifests[r] for r in ranks}
