"""The identity key file, the state-dir lock and node.json."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2

from crowdtrain.errors import BadInputError, SwarmUnreachableError
from crowdtrain.node.identity import load_identity, load_or_create_identity
from crowdtrain.node.statedir import (
    NODE_FILE,
    exclusive_state_dir,
    find_local_daemon,
    read_node_file,
    remove_node_file,
    write_node_file,
)

# --- identity ----------------------------------------------------------------------------------


def test_identity_is_created_private_and_reloads_to_the_same_peer(tmp_path: Path) -> None:
    path = tmp_path / "nested" / "identity.key"
    created = load_or_create_identity(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in path.parent.iterdir()] == ["identity.key"]  # no temporary file left behind
    data = path.read_bytes()
    reloaded = load_or_create_identity(path)
    assert path.read_bytes() == data  # reloading never rewrites the key
    assert reloaded.peer_id == created.peer_id == PeerID.from_identity(data)
    assert reloaded.path == path
    message = b"signed by the same key"
    assert created.private_key.get_public_key().verify(message, reloaded.private_key.sign(message))


def test_two_fresh_identities_differ(tmp_path: Path) -> None:
    first = load_or_create_identity(tmp_path / "a.key")
    second = load_or_create_identity(tmp_path / "b.key")
    assert first.peer_id != second.peer_id


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620])
def test_identity_open_to_other_users_is_refused_and_left_untouched(tmp_path: Path, mode: int) -> None:
    # whoever reads the key can sign records as this node: refused, as ssh refuses an open private key
    path = tmp_path / "identity.key"
    load_or_create_identity(path)
    data = path.read_bytes()
    path.chmod(mode)
    with pytest.raises(BadInputError, match="chmod 600"):
        load_identity(path)
    assert path.read_bytes() == data and stat.S_IMODE(path.stat().st_mode) == mode


def _wrapped(key_type: int, data: bytes) -> bytes:
    return crypto_pb2.PrivateKey(key_type=key_type, data=data).SerializeToString()


def _pkcs8(key: ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


NOT_KEYS = {
    "random bytes": os.urandom(1200),
    "empty file": b"",
    "text": b"-----BEGIN RSA PRIVATE KEY-----\nnot really\n",
    "ed25519 key": _wrapped(
        crypto_pb2.KeyType.Ed25519,
        ed25519.Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        ),
    ),
    "ecdsa key": _wrapped(crypto_pb2.KeyType.ECDSA, _pkcs8(ec.generate_private_key(ec.SECP256R1()))),
    "ec key labelled rsa": _wrapped(crypto_pb2.KeyType.RSA, _pkcs8(ec.generate_private_key(ec.SECP256R1()))),
    "rsa label, garbage der": _wrapped(crypto_pb2.KeyType.RSA, b"\x30\x03\x02\x01\x00"),
}


@pytest.mark.parametrize("content", list(NOT_KEYS.values()), ids=list(NOT_KEYS))
def test_file_that_is_not_a_key_is_bad_input_and_left_alone(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "identity.key"
    path.write_bytes(content)
    path.chmod(0o600)
    with pytest.raises(BadInputError, match="not a crowdtrain identity") as caught:
        load_or_create_identity(path)
    assert str(path) in str(caught.value)
    assert path.read_bytes() == content
    assert [p.name for p in tmp_path.iterdir()] == ["identity.key"]


def test_identity_path_that_is_a_directory_is_bad_input(tmp_path: Path) -> None:
    with pytest.raises(BadInputError, match="Cannot read identity file"):
        load_or_create_identity(tmp_path)


def test_identity_under_a_file_is_bad_input(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"x")
    with pytest.raises(BadInputError, match="Cannot create the directory"):
        load_or_create_identity(blocker / "identity.key")


# --- the state-dir lock ------------------------------------------------------------------------

HOLDER = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    from crowdtrain.node.statedir import exclusive_state_dir, write_node_file

    with exclusive_state_dir(Path(sys.argv[1])) as path:
        write_node_file(path, {"pid": os.getpid(), "multiaddrs": []})
        print("locked", flush=True)
        sys.stdin.readline()  # hold the lock until the test closes our stdin
    print("released", flush=True)
    """
)


def test_second_holder_of_the_state_dir_is_refused(tmp_path: Path) -> None:
    state = tmp_path / "state"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(state)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    try:
        assert holder.stdout is not None and holder.stdin is not None
        assert holder.stdout.readline().strip() == "locked"
        node_json = (state / NODE_FILE).read_bytes()
        with pytest.raises(BadInputError, match=f"pid {holder.pid}") as caught:
            with exclusive_state_dir(state):
                raise AssertionError("acquired a state dir another process holds")
        assert "already using state dir" in str(caught.value)
        assert (state / NODE_FILE).read_bytes() == node_json
        holder.stdin.close()
        assert holder.stdout.readline().strip() == "released"
        assert holder.wait(timeout=30) == 0
    finally:
        holder.kill()
        holder.wait(timeout=30)
    with exclusive_state_dir(state) as path:  # the holder's exit released the lock
        assert path == state


def test_state_dir_lock_is_exclusive_within_a_process_and_released_on_exit(tmp_path: Path) -> None:
    with exclusive_state_dir(tmp_path / "state") as path:
        assert path.is_dir()
        with pytest.raises(BadInputError, match="already using"), exclusive_state_dir(path):
            pass
    with exclusive_state_dir(tmp_path / "state"):
        pass


def test_unusable_state_dir_is_bad_input(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"x")
    with pytest.raises(BadInputError, match="--state-dir"), exclusive_state_dir(blocker / "state"):
        pass


# --- node.json ---------------------------------------------------------------------------------


def test_node_file_write_read_remove(tmp_path: Path) -> None:
    info = {"pid": 123, "peer_id": "Qm", "multiaddrs": ["/ip4/127.0.0.1/tcp/1/p2p/Qm"], "run_id": "demo"}
    assert read_node_file(tmp_path) is None
    write_node_file(tmp_path, info)
    assert read_node_file(tmp_path) == info
    assert json.loads((tmp_path / NODE_FILE).read_text()) == info
    write_node_file(tmp_path, {"pid": 456})
    assert read_node_file(tmp_path) == {"pid": 456}
    assert sorted(p.name for p in tmp_path.iterdir()) == [NODE_FILE]  # the temporary file was renamed
    remove_node_file(tmp_path)
    assert not (tmp_path / NODE_FILE).exists()
    remove_node_file(tmp_path)  # removing twice is fine
    assert read_node_file(tmp_path) is None


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", ""])
def test_unreadable_node_file_reads_as_none(tmp_path: Path, content: str) -> None:
    (tmp_path / NODE_FILE).write_text(content)
    assert read_node_file(tmp_path) is None


def test_find_local_daemon_without_node_file(tmp_path: Path) -> None:
    with pytest.raises(SwarmUnreachableError, match="No crowdtrain daemon"):
        find_local_daemon(tmp_path)


def test_find_local_daemon_with_a_dead_pid(tmp_path: Path) -> None:
    finished = subprocess.Popen(["true"])
    assert finished.wait(timeout=30) == 0  # reaped: its pid no longer names a process
    write_node_file(tmp_path, {"pid": finished.pid, "multiaddrs": ["/ip4/127.0.0.1/tcp/1"]})
    with pytest.raises(SwarmUnreachableError, match=f"pid {finished.pid}.*not running"):
        find_local_daemon(tmp_path)


@pytest.mark.parametrize(
    "info",
    [{"pid": "1234", "multiaddrs": ["/ip4/127.0.0.1/tcp/1"]}, {"multiaddrs": ["/ip4/127.0.0.1/tcp/1"]}, {"pid": 0}],
)
def test_find_local_daemon_with_an_unusable_record(tmp_path: Path, info: dict[str, object]) -> None:
    write_node_file(tmp_path, info)
    with pytest.raises(SwarmUnreachableError, match="not running"):
        find_local_daemon(tmp_path)


def test_find_local_daemon_with_a_live_pid(tmp_path: Path) -> None:
    info = {"pid": os.getpid(), "multiaddrs": ["/ip4/127.0.0.1/tcp/1"]}
    write_node_file(tmp_path, info)
    assert find_local_daemon(tmp_path) == info
    write_node_file(tmp_path, {"pid": os.getpid(), "multiaddrs": []})
    with pytest.raises(SwarmUnreachableError):
        find_local_daemon(tmp_path)
