"""ckptstore: a content-addressed checkpoint store for PyTorch training.

    from ckptstore import Store, RNGState
    store = Store("checkpoints/run1")
    start = store.resume(state)          # newest valid committed step, or None
    store.save(state, step)              # -> SaveResult

The package is layered; each subpackage imports only the ones listed before it (tests/api/test_layers.py checks it):

    util/           errors, credential redaction, retries under deadlines, background threads
    storage/        the small Storage interface: local disk, fsspec (S3, GCS, ...), retrying remote wrapper
    state/          what a training state is: key paths, RNG state, DTensor shards, run config, data position
    format/         the on-storage format: layout, chunk ids, blobs, packs, index, manifest, commit marker,
                    latest pointer, shard map, deletion intents (FORMAT.md)
    io/             state <-> chunks: snapshot, change detection, write path, read path, resharding reads,
                    foreign formats (HF Hub weights in, safetensors / torch.save out)
    lifecycle/      what happens to committed steps: writer lease, retention, gc, repack, set-aside, usage
    distributed/    how ranks agree: small collectives, the commit protocol, read-once fan-out, resume agreement
    remote/         the remote tier: background uploads in commit order, step transfer, which tier to resume from
    orchestration/  save, load and maintenance of one store, wiring the layers above; the option objects
    memtier/        the memory tier: its options, its cadence, peer replication
    store.py        ``Store``, the facade; cli.py the command line; integrations/ the trainers' adapters
"""
from .util.version import __version__
from .util.errors import (CheckpointError, CorruptCheckpointError, IncompatibleCheckpointError, TransferError,
                          UploadError)
from .util.redact import install_log_filter
from .util.retry import RetryPolicy
from .storage.local import atomic_file
from .state.data import ElasticSampler
from .state.flatten import RNGState
from .format.packs import Packing
from .lifecycle.retention import Retention
from .distributed.commit import CommitError
from .orchestration.options import Remote, Writing
from .memtier.memory import Memory
from .memtier.replication import ReplicationError
from .store import SaveResult, Store

install_log_filter()              # no credential in any ckptstore log line

__all__ = ["Store", "Memory", "Remote", "Writing", "Packing", "Retention", "RetryPolicy", "RNGState", "SaveResult",
           "ElasticSampler", "CheckpointError", "CorruptCheckpointError", "IncompatibleCheckpointError",
           "TransferError", "UploadError", "CommitError", "ReplicationError", "atomic_file", "__version__"]
