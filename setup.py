"""Build hook for the one optional C extension (project metadata lives in pyproject.toml).

``ckptstore.format._planes``: the planes codec in C (ckptstore/format/_planes.c: byte split / merge ~3-5x the
numpy code per core, whole frames in one call with zstd called through python-zstandard's own functions). ``optional=True``: where no C compiler or Python headers exist the install goes on without
it and ckptstore/format/planes.py uses its numpy code (same frames, slower); ``CKPTSTORE_NATIVE=0`` forces that.
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension("ckptstore.format._planes", ["ckptstore/format/_planes.c"], optional=True,
                             extra_compile_args=["-O3"], libraries=["m", "pthread"])])
