"""A message signed by its author's identity key, checked against the peer ID it claims to come from.

A node's identity key is also its libp2p key, so its peer ID is the hash of the key's public half
(`peer_id_of_public_key`): a message a peer relays for others (an averaging round's leader sends every member's
gathered data to all) carries its author's public key and signature, and any reader checks both against the peer
ID the message is attributed to. Sizes are capped before anything is parsed and the key at MAX_KEY_BITS, so a
check costs at most one RSA verify of a bounded key.
"""

from __future__ import annotations

from typing import Any

from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from crowdtrain.dht.records import RecordError, load_public_key, peer_id_of_public_key

MAX_PUBLIC_KEY_BYTES = 1024
"""Cap on an author's OpenSSH public key (an RSA-4096 key is 725 bytes)."""
MAX_SIGNATURE_BYTES = 1024
"""Cap on an author's base64 signature (an RSA-4096 key's is 684 bytes)."""
MAX_KEY_BITS = 4096
"""The largest RSA key whose signature is verified: bounds a verify's cost (libp2p's own keys are 2048 bits)."""


def sign(private_key: RSAPrivateKey, message: bytes) -> list[bytes]:
    """[public key, signature] of `message` by `private_key`, as it travels beside the message."""
    return [private_key.get_public_key().to_bytes(), private_key.sign(message)]


def key_peer_id(private_key: RSAPrivateKey) -> str:
    """The peer ID (base58) that `private_key` derives: messages it signs verify only under that one."""
    return peer_id_of_public_key(load_public_key(private_key.get_public_key().to_bytes())).to_base58()


def is_authored_by(peer_id: str, author: Any, message: bytes) -> bool:
    """Whether `author` ([public key, signature], as `sign` made it) is a signature of `message` by the key that
    `peer_id` (base58) derives from. Never raises: anything malformed is False."""
    if not isinstance(author, list | tuple) or len(author) != 2:
        return False
    public_key, signature = author
    if not isinstance(public_key, bytes) or not isinstance(signature, bytes):
        return False
    if len(public_key) > MAX_PUBLIC_KEY_BYTES or len(signature) > MAX_SIGNATURE_BYTES:
        return False
    try:
        key = load_public_key(public_key)
    except RecordError:
        return False
    if key.key_size > MAX_KEY_BITS or peer_id_of_public_key(key).to_base58() != peer_id:
        return False
    return bool(RSAPublicKey(key).verify(message, signature))
