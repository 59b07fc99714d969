"""Utilities every layer may use: the exceptions (:mod:`.errors`), credential redaction (:mod:`.redact`), retries
with backoff under an overall deadline (:mod:`.retry`), background threads that yield the CPU (:mod:`.threads`),
the package version.

Imports: the standard library, torch and msgpack only; nothing else of ckptstore.
"""
