"""What a training state is, before any byte is stored: flattening ``state_dict`` trees and Stateful objects into
key paths and back, RNG states (:class:`~.flatten.RNGState`), DTensor placements and shards (:mod:`.sharding`), the
run's config checked on resume (:mod:`.runconfig`), and the elastic data sampler (:mod:`.data`).

Imports: :mod:`ckptstore.util` only.
"""
