"""The remote tier: the background uploader that copies committed steps in commit order and survives a kill
(:mod:`.upload`), step transfer between two storages (:mod:`.transfer`), and which tier and step to resume from
(:mod:`.resolve`).

Imports: the layers below (:mod:`ckptstore.util` to :mod:`ckptstore.distributed`).
"""
