"""The on-storage format (FORMAT.md): where things live (:mod:`.layout`), content-addressed blobs and chunk ids
(:mod:`.blobs`), the codecs for floats and for deltas (:mod:`.planes`, :mod:`.delta`), packs of small chunks (:mod:`.packs`), the chunk index (:mod:`.index`), manifests and commit
markers (:mod:`.manifest`), reading them off a storage (:mod:`.catalog`), the latest pointer (:mod:`.pointers`), the
shard map (:mod:`.shardmap`) and remote-deletion intents (:mod:`.intents`). Everything here is a record, its
encoding, its validation as untrusted input and its write order; nothing decides when to write.

Imports: :mod:`ckptstore.util`, :mod:`ckptstore.storage`, :mod:`ckptstore.state`.
"""
