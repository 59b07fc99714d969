"""ckptstore: a content-addressed checkpoint store for PyTorch training.

    from ckptstore import Store, RNGState
    store = Store("checkpoints/run1")
    start = store.resume(state)          # newest valid committed step, or None
    store.save(state, step)              # -> SaveResult
"""
__version__ = "0.1.0"

from .errors import (CheckpointError, CorruptCheckpointError, IncompatibleCheckpointError, TransferError,  # noqa: E402
                     UploadError)
from .commit import CommitError  # noqa: E402
from .data import ElasticSampler  # noqa: E402
from .memory import Memory  # noqa: E402
from .options import Remote, Writing  # noqa: E402
from .packs import Packing  # noqa: E402
from .redact import install_log_filter  # noqa: E402
from .replication import ReplicationError  # noqa: E402
from .retention import Retention  # noqa: E402
from .retry import RetryPolicy  # noqa: E402
from .state import RNGState  # noqa: E402
from .store import SaveResult, Store  # noqa: E402

install_log_filter()              # no credential in any ckptstore log line

__all__ = ["Store", "Memory", "Remote", "Writing", "Packing", "Retention", "RetryPolicy", "RNGState", "SaveResult",
           "ElasticSampler", "CheckpointError", "CorruptCheckpointError", "IncompatibleCheckpointError",
           "TransferError", "UploadError", "CommitError", "ReplicationError", "__version__"]
