"""One store's save, load and upkeep, wiring the layers below: the option objects (:mod:`.options`), the
parts a store's modules share (:mod:`.parts`), saving (:mod:`.saving`), loading and resume (:mod:`.loading`), and
retention, gc and repack after commits and uploads (:mod:`.maintenance`).

Imports: the layers below (:mod:`ckptstore.util` to :mod:`ckptstore.remote`).
"""
