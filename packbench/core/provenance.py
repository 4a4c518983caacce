"""Signed provenance of sealed archives: Ed25519 over the archive's and its manifest's SHA-256.

What a signature proves: the holder of one deployment's signing key sealed exactly these
bytes (where and by whom the archive was made). What it does not prove: that the numbers are
true; the audit's recomputation and the database speak to that. See docs/archive.md,
"Signed provenance".

The signature is detached: ``<archive>.sig`` next to the archive (a member would change the
manifest it signs). It holds one canonical JSON object, the *envelope*:

    {"scheme": "packbench-ed25519-v1", "archive_sha256": hex, "manifest_sha256": hex,
     "key_id": first 16 hex of SHA-256(raw public key), "public_key": 64 hex, "signature": 128 hex}

The signed message is ``message(archive_sha256, manifest_sha256)``. Keys are files: the private
key a PKCS#8 PEM (mode 0600, outside archives and the database), the public key a
SubjectPublicKeyInfo PEM (``<key>.pub``), registered in the database by ``packbench keys``.

Pure Python + ``cryptography`` (a well-kept library: no hand-written crypto here).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from packbench.core.canonical import canonical_json
from packbench.core.errors import PackbenchError

SCHEME = "packbench-ed25519-v1"
SIGNATURE_SUFFIX = ".sig"
MAX_SIGNATURE_BYTES = 4096  # an envelope is ~400 bytes; anything larger is not one
MAX_KEY_FILE_BYTES = 16384
_HEX64 = re.compile(r"[0-9a-f]{64}")
ENVELOPE_KEYS = ("archive_sha256", "key_id", "manifest_sha256", "public_key", "scheme", "signature")
# What a signature check can say; only "valid" from a trusted key lets an audit agree.
STATUSES = ("valid", "unsigned", "unknown-signer", "bad-signature", "malformed")


class ProvenanceError(PackbenchError):
    """A key file or a signature that cannot be used; the message names the fix."""


def message(archive_sha256: str, manifest_sha256: str) -> bytes:
    """The bytes that are signed: the scheme and both digests, one per line."""
    return f"{SCHEME}\narchive {archive_sha256}\nmanifest {manifest_sha256}\n".encode("ascii")


def key_id(public_raw: bytes) -> str:
    return hashlib.sha256(public_raw).hexdigest()[:16]


def signature_path(archive: Path) -> Path:
    archive = Path(archive)
    return archive.with_name(archive.name + SIGNATURE_SUFFIX)


def _crypto():
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    return serialization, ed25519


def _read_small(path: Path, what: str) -> bytes:
    from packbench.core.files import NotReadable, read_bounded

    path = Path(path)
    try:
        return read_bounded(path, limit=MAX_KEY_FILE_BYTES)  # a FIFO or /dev/zero as a key: refused, not read
    except NotReadable as e:
        why = f"is too large to be a {what}" if e.too_large else str(e)
        raise ProvenanceError(f"{path} {why}; pass the {what} file `packbench keys init` wrote") from None
    except OSError as e:
        raise ProvenanceError(f"cannot read the {what} {path} ({e.strerror or e}); check the path") from None


def private_mode_problem(path: Path, mode: int) -> str | None:
    """Why a private key file of permission bits `mode` must not be used, or None: as ssh does, a
    key that its group or others may read or write is refused (someone else may hold it, or swap
    it for theirs, and sign as this deployment). The line names the file, its mode and the fix."""
    if mode & 0o077 == 0:
        return None
    return (f"the signing key {path} has mode {mode & 0o7777:04o}: its group or others may read or write it, so it "
            f"is not private; run `chmod 600 {path}` (and make a new key with `packbench keys init` if others may "
            f"have read it)")


@dataclass(frozen=True)
class Signer:
    """A deployment's signing key, loaded once (the dispatcher holds one)."""

    private_pem: bytes
    public_raw: bytes

    @property
    def key_id(self) -> str:
        return key_id(self.public_raw)

    @classmethod
    def load(cls, path: Path) -> "Signer":
        serialization, ed25519 = _crypto()
        data = _read_small(path, "signing key")  # first: a FIFO or a device is named as such
        problem = private_mode_problem(path, os.stat(path).st_mode) if os.name == "posix" else None
        if problem is not None:
            raise ProvenanceError(problem)
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError) as e:
            raise ProvenanceError(f"{path} is not an unencrypted PEM private key ({e}); "
                                  f"create one with `packbench keys init`") from None
        if not isinstance(key, ed25519.Ed25519PrivateKey):
            raise ProvenanceError(f"{path} is not an Ed25519 key; create one with `packbench keys init`")
        raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        return cls(data, raw)

    def envelope(self, archive_sha256: str, manifest_sha256: str) -> dict:
        serialization, _ = _crypto()
        key = serialization.load_pem_private_key(self.private_pem, password=None)
        sig = key.sign(message(archive_sha256, manifest_sha256))
        return {"scheme": SCHEME, "archive_sha256": archive_sha256, "manifest_sha256": manifest_sha256,
                "key_id": self.key_id, "public_key": self.public_raw.hex(), "signature": sig.hex()}

    def sign_archive(self, archive: Path, archive_sha256: str, manifest_sha256: str) -> Path:
        """Write ``<archive>.sig`` (exclusive create: a signature is never overwritten)."""
        out = signature_path(archive)
        data = canonical_json(self.envelope(archive_sha256, manifest_sha256))
        try:
            fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            raise ProvenanceError(f"a signature already exists at {out}; signatures are never overwritten") from None
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return out


def generate_key(path: Path) -> tuple[Path, Path, str]:
    """Create a new Ed25519 key: ``path`` (private, 0600, never overwritten) and ``path.pub``."""
    serialization, ed25519 = _crypto()
    path = Path(path)
    pub = path.with_name(path.name + ".pub")
    for there in (path, pub):  # the one that is there is named: `--key k` with only k.pub named k
        if there.exists():
            raise ProvenanceError(f"a key already exists at {there}; keys are never overwritten (choose another --key)")
    path.parent.mkdir(parents=True, exist_ok=True)
    key = ed25519.Ed25519PrivateKey.generate()
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.PEM,
                                           serialization.PublicFormat.SubjectPublicKeyInfo)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(private)
    pub.write_bytes(public)
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return path, pub, key_id(raw)


def load_public_key(path: Path) -> bytes:
    """The raw 32-byte Ed25519 public key of a ``.pub`` PEM file (or 64 hex digits)."""
    serialization, ed25519 = _crypto()
    data = _read_small(path, "public key")
    text = data.decode("ascii", "replace").strip()
    if re.fullmatch(r"[0-9a-f]{64}", text):
        return bytes.fromhex(text)
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError) as e:
        raise ProvenanceError(f"{path} is not a PEM public key ({e}); pass the .pub file `packbench keys init` "
                              f"wrote") from None
    if not isinstance(key, ed25519.Ed25519PublicKey):
        raise ProvenanceError(f"{path} is not an Ed25519 public key")
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def public_pem(raw: bytes) -> str:
    serialization, ed25519 = _crypto()
    key = ed25519.Ed25519PublicKey.from_public_bytes(raw)
    return key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()


@dataclass(frozen=True)
class SignatureCheck:
    status: str  # one of STATUSES
    key_id: str | None
    line: str | None  # the problem line; None when valid

    @property
    def valid(self) -> bool:
        return self.status == "valid"


def check_signature(sig_path: Path, *, archive_sha256: str | None, manifest_sha256: str | None,
                    trusted: list[bytes]) -> SignatureCheck:
    """Verify a detached signature against the archive's digests and the trusted public keys.

    Never raises for a hostile file: every outcome is a status and, unless valid, one line.
    """
    serialization, ed25519 = _crypto()
    sig_path = Path(sig_path)
    if not sig_path.is_file():
        if os.path.lexists(sig_path):  # before, a directory or FIFO there was called "no ... next to the archive"
            return SignatureCheck("unsigned", None, f"signature: unsigned ({sig_path.name} next to the archive is not "
                                                    f"a regular file; put the .sig file the signer wrote there)")
        return SignatureCheck("unsigned", None, f"signature: unsigned (no {sig_path.name} next to the archive)")
    try:
        if sig_path.stat().st_size > MAX_SIGNATURE_BYTES:
            return SignatureCheck("malformed", None, f"signature: {sig_path.name} is not a signature envelope (too large)")
        raw = sig_path.read_bytes()
        env = json.loads(raw.decode("utf-8"))
    except (OSError, ValueError, UnicodeDecodeError, RecursionError) as e:
        return SignatureCheck("malformed", None, f"signature: {sig_path.name} is not a signature envelope ({type(e).__name__})")
    ok = (isinstance(env, dict) and tuple(sorted(env)) == ENVELOPE_KEYS and env.get("scheme") == SCHEME
          and all(isinstance(env[k], str) for k in ENVELOPE_KEYS)
          and re.fullmatch(r"[0-9a-f]{64}", env["public_key"]) is not None
          and re.fullmatch(r"[0-9a-f]{128}", env["signature"]) is not None
          and canonical_json(env) == raw)
    if not ok:
        return SignatureCheck("malformed", None, f"signature: {sig_path.name} is not a {SCHEME} envelope")
    public = bytes.fromhex(env["public_key"])
    kid = key_id(public)
    if env["key_id"] != kid:
        return SignatureCheck("malformed", kid, f"signature: key_id {env['key_id']} is not the id of its public key")
    if archive_sha256 is None or manifest_sha256 is None:
        return SignatureCheck("bad-signature", kid, "signature: the archive has no readable manifest to check it against")
    if env["archive_sha256"] != archive_sha256 or env["manifest_sha256"] != manifest_sha256:
        return SignatureCheck("bad-signature", kid, f"signature: by key {kid}, for other bytes (the archive or its "
                                                    f"manifest changed after signing)")
    try:
        ed25519.Ed25519PublicKey.from_public_bytes(public).verify(
            bytes.fromhex(env["signature"]), message(archive_sha256, manifest_sha256))
    except Exception:  # InvalidSignature, or a public key that is not a curve point
        return SignatureCheck("bad-signature", kid, f"signature: bad signature by key {kid}")
    if public not in trusted:
        return SignatureCheck("unknown-signer", kid, f"signature: valid, but by key {kid}, which is not trusted here")
    return SignatureCheck("valid", kid, None)


# ----------------------------------------------------------------------------- what was measured

CHECKPOINT_SCHEME = b"packbench-checkpoint-v1\n"


def checkpoint_digest(path: Path) -> str:
    """Content digest of a checkpoint directory: SHA-256 over, for every regular file in sorted
    relative-path order, ``path NUL size NUL sha256(bytes) LF``. A synthetic checkpoint's
    generated files (config.json carries the spec) are hashed the same way, so the digest pins
    the spec and whatever the generator wrote for it. Reads every byte once (~1-2 GB/s).
    Hidden entries (a name starting with '.', at any depth) are not the checkpoint: `.git/` of a
    clone and `.cache/huggingface/` of `huggingface-cli download --local-dir` hold timestamps and
    download metadata, so the same weights fetched twice had different digests (a `sha256` pin
    refused the second copy). No generated checkpoint holds one, so no archived digest moves."""
    root = Path(path)
    h = hashlib.sha256(CHECKPOINT_SCHEME)
    files = (p for p in root.rglob("*")
             if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts))
    for f in sorted(files, key=lambda p: p.relative_to(root).as_posix()):
        fh = hashlib.sha256()
        size = 0
        with open(f, "rb") as fp:
            for chunk in iter(lambda: fp.read(1 << 20), b""):
                fh.update(chunk)
                size += len(chunk)
        h.update(f"{f.relative_to(root).as_posix()}\0{size}\0{fh.hexdigest()}\n".encode())
    return h.hexdigest()
