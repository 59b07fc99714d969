"""State to chunks and back, for one rank: stable byte views of a state's arrays (:mod:`.snapshot`), which of them
are unchanged since the last save (:mod:`.changes`), the write path to blobs and packs (:mod:`.writer`; deltas against the parent step: :mod:`.deltas`), the read
path back to tensors (:mod:`.reader`), reading a step for any world size and mesh (:mod:`.restore`), and foreign
formats: Hugging Face Hub weights in (:mod:`.hub`), ``.safetensors`` / ``.pt`` out (:mod:`.export`).

Imports: :mod:`ckptstore.util`, :mod:`ckptstore.storage`, :mod:`ckptstore.state`, :mod:`ckptstore.format`.
"""
