"""Who built a bundle: Ed25519 signatures over its manifest.

A bundle is executable code: Inductor's Python wrappers are imported, its cache entries unpickled and its shared
objects loaded when it serves. The manifest lists the sha256 of every file and hashes its own content
(`manifest_sha256`), so `h3trt verify` catches accidents (a truncated copy, a flipped bit, an edited field) but not
intent: whoever can edit a file can edit its hash too. A signature closes that gap:

    h3trt keygen KEY                       KEY (private, mode 0600) and KEY.pub
    h3trt build ... --sign KEY             the builder writes manifest.sig: Ed25519 over manifest.json's bytes
    h3trt verify DIR --trust KEY.pub       the signature, then every file against the manifest
    h3trt run --engine DIR --trust KEY.pub the same checks before any of the bundle's code loads

Keys are PEM (PKCS#8 private, SubjectPublicKeyInfo public), so OpenSSL's work too:
`openssl genpkey -algorithm ed25519 -out KEY` and `openssl pkey -in KEY -pubout -out KEY.pub`.
The signature covers manifest.json byte for byte, and through its file table every other file; manifest.sig itself
is the only file the manifest does not list.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import UserError
from .manifest import MANIFEST, SIGNATURE, BundleError, Manifest, parse_manifest

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

# `cryptography` (install_requires) is imported where a key is made, read or checked: a process that serves a bundle
# without --trust (every rank of a GPU job launched from a bare image, say) never needs it.

ALGORITHM = "ed25519"


def key_fingerprint(public_key: Ed25519PublicKey) -> str:
    """sha256 of the raw 32-byte public key, hex: what records and messages name a key by."""
    from cryptography.hazmat.primitives import serialization

    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()


def generate_key(path: Path) -> tuple[Path, Path]:
    """A new Ed25519 key pair: `path` (private, PEM PKCS#8, mode 0600) and `path`.pub (public, PEM). Refuses to
    replace existing files, and a folder it cannot write, in one line; leaves nothing behind when it fails."""
    path = Path(path)
    public_path = path.with_name(path.name + ".pub")
    for p in (path, public_path):
        if p.exists():
            raise UserError(f"{p} already exists; choose another key path (an existing key is never replaced).")
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.PEM,
                                           serialization.PublicFormat.SubjectPublicKeyInfo)
    written = []
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        written.append(path)
        with os.fdopen(fd, "wb") as f:
            f.write(private)
        fd = os.open(public_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        written.append(public_path)
        with os.fdopen(fd, "wb") as f:
            f.write(public)
    except OSError as e:
        for p in written:
            p.unlink(missing_ok=True)
        raise UserError(_unwritable(path, e)) from None
    return path, public_path


def _unwritable(path: Path, error: OSError) -> str:
    folder = path.parent
    if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        why = f"the folder {folder} is not writable ({error.strerror})"
    elif error.errno == errno.ENOENT:
        why = f"the folder {folder} does not exist"
    else:
        why = f"{error.strerror}"
    return f"cannot write the key {path}: {why}; nothing was written. Choose a folder you can write to."


def load_private_key(path: Path) -> Ed25519PrivateKey:
    return _load_ed25519(path, private=True)


def load_public_key(path: Path) -> Ed25519PublicKey:
    return _load_ed25519(path, private=False)


_KEY_HINTS = {  # private: what a wrong file passed to --sign / --trust is told to pass instead
    True: "make one with `h3trt keygen KEY` or `openssl genpkey -algorithm ed25519 -out KEY`.",
    False: "pass the KEY.pub of the key that signed the bundle (`openssl pkey -in KEY -pubout` prints it).",
}


def _load_ed25519(path: Path, private: bool):
    """The Ed25519 key in PEM file `path` (private for --sign, public for --trust); any other key is refused."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

    want = Ed25519PrivateKey if private else Ed25519PublicKey
    key = _load(Path(path), private)
    if not isinstance(key, want):
        raise UserError(f"{'--sign' if private else '--trust'} {path} is a {type(key).__name__}, not an Ed25519 "
                         f"{'private' if private else 'public'} key; {_KEY_HINTS[private]}")
    return key


def _load(path: Path, private: bool):
    from cryptography.hazmat.primitives import serialization

    flag = "--sign" if private else "--trust"
    try:
        data = path.read_bytes()
    except OSError as e:
        raise UserError(f"{flag} {path}: cannot read the key ({e.strerror}).") from None
    try:
        if private:
            return serialization.load_pem_private_key(data, password=None)
        return serialization.load_pem_public_key(data)
    except (ValueError, TypeError) as e:
        what = "private" if private else "public"
        raise UserError(f"{flag} {path} is not a PEM {what} key without a password ({e}).") from None


def sign_bundle(root: Path, key: Ed25519PrivateKey) -> dict:
    """Write ROOT/manifest.sig: an Ed25519 signature over manifest.json's bytes. Returns what it wrote."""
    root = Path(root)
    manifest = (root / MANIFEST).read_bytes()
    record = {"algorithm": ALGORITHM, "key_sha256": key_fingerprint(key.public_key()),
              "manifest_file_sha256": hashlib.sha256(manifest).hexdigest(),
              "signature": base64.b64encode(key.sign(manifest)).decode()}
    tmp = root / f".{SIGNATURE}.partial"
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, root / SIGNATURE)
    return record


def read_signature(root: Path) -> dict | None:
    """ROOT/manifest.sig as written by sign_bundle, unverified; None if the bundle is unsigned."""
    path = Path(root) / SIGNATURE
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text())
        base64.b64decode(record["signature"], validate=True)
        if record["algorithm"] != ALGORITHM:
            raise ValueError(f"algorithm {record['algorithm']!r}")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise BundleError(f"{path} is not a bundle signature h3trt reads ({e}); re-copy the bundle.") from None
    return record


def read_trusted_manifest(root: Path, trust: Path | Ed25519PublicKey) -> Manifest:
    """The manifest, only if its bytes carry a valid signature by `trust` (a public key or its PEM file). The bytes
    are read once and the signature checked before they are parsed; the caller then checks every file against
    the returned manifest (verify_files) before it loads any of the bundle's code."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    root = Path(root)
    public_key = trust if isinstance(trust, Ed25519PublicKey) else load_public_key(trust)
    record = read_signature(root)
    if record is None:
        raise BundleError(f"{root} is not signed (no {SIGNATURE}), and --trust asks for a signed bundle; rebuild it "
                          "with `h3trt build ... --sign KEY`, or drop --trust to serve it unchecked.")
    try:
        data = (root / MANIFEST).read_bytes()
    except OSError as e:
        raise BundleError(f"{root}: cannot read {MANIFEST} ({e.strerror}).") from None
    try:
        public_key.verify(base64.b64decode(record["signature"]), data)
    except InvalidSignature:
        trusted, signer = key_fingerprint(public_key), str(record.get("key_sha256", "?"))
        why = ("the manifest changed after it was signed" if signer == trusted
               else f"it was signed by key {signer[:16]}...")
        raise BundleError(f"{root}: the signature does not verify against the trusted key {trusted[:16]}... ({why}); "
                          "the bundle is refused and none of its code was loaded. Re-copy it from its builder, or "
                          "rebuild and sign it.") from None
    return parse_manifest(data, root)
