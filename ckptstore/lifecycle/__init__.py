"""What happens to committed steps over time, on one storage: who may write and delete (:mod:`.lease`), which
steps to keep (:mod:`.retention`, pure policies), garbage collection (:mod:`.gc`), repacking (:mod:`.repack`),
setting newer steps aside when a run rewinds (:mod:`.rewind`), and what each step occupies (:mod:`.usage`).

Imports: :mod:`ckptstore.util`, :mod:`ckptstore.storage`, :mod:`ckptstore.state`, :mod:`ckptstore.format`,
:mod:`ckptstore.io`.
"""
