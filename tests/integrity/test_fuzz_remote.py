"""Fuzzing a hostile bucket (issue 17, section 3): the mutations of ``test_fuzz.py`` (structural and byte damage of
step 20's manifest and commit marker, re-framed with valid checksums; damaged or lying blobs and packs) applied
to a store that is then put in the loopback S3 server, and resumed by a job whose local root is empty.

A case fails if anything but a ``CheckpointError`` escapes ``resume``, if it takes longer than ``CASE_SECONDS``
(a retry loop on damage), if it starts fresh although step 10 is intact, or if it returns step 10 with other
values. Special files (FIFOs, links) have no object-store form: those mutations are skipped. Seeded, bounded:
``CKPTSTORE_FUZZ_REMOTE_CASES`` cases (default 40)."""
import os
import random
import shutil
import stat
import time

import pytest

import test_fuzz as F
from ckptstore import CheckpointError, Store, Remote
from ckptstore.util.retry import RetryPolicy

pytestmark = pytest.mark.remote
CASES = int(os.environ.get("CKPTSTORE_FUZZ_REMOTE_CASES", "40"))
CASE_SECONDS = 30.0


def _regular_only(root) -> bool:
    """No FIFO, link or device (a directory at a file's path is uploaded as nothing: a missing object)."""
    return all(stat.S_ISREG(m) or stat.S_ISDIR(m) for m in (os.lstat(p).st_mode for p in root.rglob("*")))


def test_fuzz_hostile_bucket_resumes_step_10_or_20_and_raises_only_checkpoint_errors(tmp_path, s3_bucket_url):
    import s3fs

    url, opts = s3_bucket_url
    fs = s3fs.S3FileSystem(**opts)
    template = tmp_path / "template"
    expected10, own_files, _ = F.build_template(template)
    rng = random.Random(int(os.environ.get("CKPTSTORE_FUZZ_SEED", "7")))
    failures, outcomes, skipped = [], {10: 0, 20: 0}, 0
    for case in range(CASES):
        root = tmp_path / f"case{case}"
        shutil.copytree(template, root, symlinks=True)
        what = F.mutate_case(random.Random(rng.getrandbits(64)), root, own_files, tmp_path)
        if not _regular_only(root):
            skipped += 1
            shutil.rmtree(root, ignore_errors=True)
            continue
        prefix = f"{url}/case{case}"
        fs.put(str(root) + "/", prefix[len("s3://"):], recursive=True)
        state = {k: None for k in expected10}
        t0 = time.monotonic()
        try:
            remote = Remote(prefix, retry=RetryPolicy(deadline=10, op_timeout=5), upload=False)
            with Store(tmp_path / f"local{case}", remote=remote, storage_options=opts) as s:
                step = s.resume(state)
            if step not in (10, 20):
                failures.append(f"case {case} ({what}): resume returned {step!r} although step 10 is intact")
            elif step == 10 and not F.bits_equal(expected10, state):
                failures.append(f"case {case} ({what}): step 10 resumed with other values")
            else:
                outcomes[step] += 1
        except CheckpointError as e:
            failures.append(f"case {case} ({what}): no fallback to step 10 ({type(e).__name__}: {str(e)[:150]})")
        except Exception as e:            # noqa: BLE001 - the point of the test
            failures.append(f"case {case} ({what}): {type(e).__name__}: {str(e)[:200]}")
        if time.monotonic() - t0 > CASE_SECONDS:
            failures.append(f"case {case} ({what}): took {time.monotonic() - t0:.0f} s")
        shutil.rmtree(root, ignore_errors=True)
    assert outcomes[10] and CASES - skipped >= CASES // 2, (outcomes, skipped)
    assert not failures, f"{len(failures)} of {CASES - skipped} cases failed:\n" + "\n".join(failures[:30])
