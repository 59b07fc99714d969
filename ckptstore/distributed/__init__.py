"""How the ranks of a job agree, off the training's own collectives: small messages with deadlines
(:mod:`.collective`), the commit protocol that makes a step visible on every rank or none (:mod:`.commit`), reading
each byte once at resume (:mod:`.fanout`), and the agreement on which step to resume (:mod:`.resume`).

Imports: the layers below (:mod:`ckptstore.util` to :mod:`ckptstore.lifecycle`).
"""
