"""Canonical JSON: the one byte form used for freezing, hashing and digests."""

import hashlib
import json
from typing import Any


def canonical_json(obj: Any) -> bytes:
    """Sorted keys, no whitespace, UTF-8, no NaN/Infinity.

    Floats use Python's shortest round-trip repr, which is the same on every platform, so the
    bytes (and the SHA-256 over them) depend only on the values, never on key order or layout.
    """
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def canonical_sha256(obj: Any) -> str:
    return sha256_hex(canonical_json(obj))
