"""The memory tier in front of disk and remote: its options and capacity rule (:mod:`.memory`), its cadence and
promotion to disk (:mod:`.tiering`), and peer replication with the rebuild of a lost node's parts
(:mod:`.replication`).

Imports: every layer below, up to :mod:`ckptstore.orchestration`.
"""
