"""The node's persistent identity: one RSA key file gives a stable peer ID and signs its records."""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from google.protobuf.message import DecodeError
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey

from crowdtrain.errors import BadInputError

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Identity:
    """A loaded identity: the key that signs our records and the peer ID p2pd derives from it."""

    private_key: RSAPrivateKey
    peer_id: PeerID
    path: Path


def load_or_create_identity(path: Path) -> Identity:
    """Load the key at `path`, creating it (mode 0600) on first start."""
    if not path.exists():
        _create(path)
        logger.info(f"created a new identity in {path}")
    return load_identity(path)


def load_identity(path: Path) -> Identity:
    """Load a libp2p RSA private key file; a file that is not one is bad input, left untouched."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise BadInputError(f"Cannot read identity file {path}: {e.strerror}.") from None
    key = _parse_key(data)
    if key is None:
        raise BadInputError(
            f"{path} is not a crowdtrain identity (a libp2p RSA private key); "
            "pass --identity with the right file, or move this one away to create a new identity."
        )
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        # Whoever can read the key can sign records as this node: refused, as ssh refuses an open private key.
        raise BadInputError(
            f"Identity file {path} can be read or written by other users (mode {mode:04o}); run: chmod 600 {path}"
        )
    private_key = RSAPrivateKey.__new__(RSAPrivateKey)
    private_key.__setstate__(
        {
            "_private_key": key.private_bytes(
                serialization.Encoding.DER, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()
            )
        }
    )
    return Identity(private_key=private_key, peer_id=PeerID.from_identity(data), path=path)


def _parse_key(data: bytes) -> rsa.RSAPrivateKey | None:
    try:
        wrapped = crypto_pb2.PrivateKey.FromString(data)
        if wrapped.key_type != crypto_pb2.KeyType.RSA:
            return None
        key = serialization.load_der_private_key(wrapped.data, password=None)
    except (DecodeError, ValueError, TypeError):
        return None
    return key if isinstance(key, rsa.RSAPrivateKey) else None


def _create(path: Path) -> None:
    """Write a new key atomically: a crash never leaves a half-written identity behind."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as e:
        raise BadInputError(f"Cannot create the directory {path.parent} for the identity: {e.strerror}.") from None
    key = RSAPrivateKey()
    data = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=key.to_bytes()).SerializeToString()
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.link(temporary, path)  # fails rather than overwrite an identity created meanwhile
    except FileExistsError:
        pass
    except OSError as e:
        raise BadInputError(f"Cannot write identity file {path}: {e.strerror}.") from None
    finally:
        temporary.unlink(missing_ok=True)
