"""Adapters that put ckptstore under the trainers people use. Each module imports its trainer lazily (importing
``ckptstore`` never imports a trainer) and uses only ckptstore's public API:

- ``ckptstore.integrations.transformers``: ``CkptstoreTrainer``, ``CkptstoreTrainerMixin`` (HF ``Trainer``)
- ``ckptstore.integrations.lightning``: ``CkptstoreCheckpointIO``, ``CkptstoreModelParallelStrategy``
- ``ckptstore.integrations.torchtitan``: ``CkptstoreCheckpointManager``
- ``ckptstore.integrations.accelerate``: ``accelerator_state``, ``replicated_keys``

Install a trainer with its extra, e.g. ``pip install "ckptstore[lightning]"``. Each module checks, at import, that
the trainer's version has the methods it overrides, and raises ``ImportError`` naming them when it does not.
"""
