"""An invite-only run with real daemons: a joiner with the founder's token gets in and trains, others are refused
at the DHT and at every RPC, a second identity on a one-identity token is refused, and a revoked token's node stops."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from hivemind.p2p import P2P, P2PHandlerError, PeerID
from hivemind.utils.crypto import RSAPrivateKey
from lab.fixtures import tiny_run_file
from lab.processes import await_condition
from lab.swarm import StatusWatcher, crowdtrain, peer_ids

from crowdtrain import proto
from crowdtrain.dht.admission import issue_join_token
from crowdtrain.links.probes import NAMESPACE, ProbeService
from tests.harness import STARTED, start_daemon

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(400)]

INVITE_RUN = 'admission = "invite"\n'
TRAIN_ENV = {"CROWDTRAIN_MICRO_BATCH_SIZE": "8"}


def _invite(state_dir: Path, *args: str) -> str:
    result = crowdtrain("invite", "--state-dir", str(state_dir), *args)
    assert result.returncode == 0, result.stderr
    return next(line.strip() for line in result.stdout.splitlines() if line.strip().startswith("ctjoin1."))


async def _outsider_probe(address: str, peer_id: str) -> str:
    """Call the peer's download probe from a p2p node of our own that holds no access token; the error text."""
    p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=[address])
    try:
        stub = ProbeService.get_stub(p2p, PeerID.from_base58(peer_id), namespace=NAMESPACE)
        async for _ in await stub.rpc_download_probe(proto.DownloadRequest(num_bytes=1000)):
            return "answered"
        return "answered nothing"
    except P2PHandlerError as e:
        return str(e)
    finally:
        await p2p.shutdown()


def test_an_invite_only_run_admits_token_holders_and_refuses_the_rest(tmp_path: Path) -> None:
    run_file = tmp_path / "run.toml"
    run_file.write_text(INVITE_RUN + tiny_run_file("tiny", 1024))
    founder = start_daemon(tmp_path / "founder", "--run-file", str(run_file), env=TRAIN_ENV).await_ready()
    token = _invite(tmp_path / "founder", "--expires", "1h", "--label", "alice")

    joiner = start_daemon(
        tmp_path / "joiner", initial_peers=[founder.address], env={**TRAIN_ENV, "CROWDTRAIN_JOIN_TOKEN": token}
    ).await_ready()
    assert joiner.info["run_id"] == "tiny"

    # The joiner trains with the founder: matchmaking and all-reduce go through the gated averager RPCs.
    watcher = StatusWatcher(STARTED, founder.address, 1.0, tmp_path / "status.log", CROWDTRAIN_JOIN_TOKEN=token)

    def both_at_epoch_2() -> dict | None:
        snapshot = watcher.latest()
        if snapshot is None:
            return None
        peers = {peer["peer_id"]: peer for peer in snapshot["peers"]}
        done = {founder.peer_id, joiner.peer_id} <= peers.keys() and all(p["epoch"] >= 2 for p in peers.values())
        return snapshot if done else None

    snapshot = await_condition(both_at_epoch_2, 240, "both members at epoch 2", poll_s=1)
    assert peer_ids(snapshot) == {founder.peer_id, joiner.peer_id}
    logs = founder.log() + joiner.log()
    assert "not admitted" not in logs and "refused rpc_" not in logs

    # A p2p node without a token reaches the founder's p2pd, but none of its RPCs.
    answer = asyncio.run(_outsider_probe(founder.address, founder.peer_id))
    assert "is not admitted to this invite-only run" in answer, answer
    await_condition(lambda: "refused rpc_download_probe from" in founder.log(), 10, "the founder to log the refusal")

    # A node without a token, a reader without one, and a well-formed token for a run of the same name signed by
    # another key are refused at the DHT. One after the other: run at once, their bootstraps load the founder's DHT
    # enough on two cores that one can run past its 90 s.
    nodes = ("--listen", "/ip4/127.0.0.1/tcp/0", "--bootstrap-timeout", "5", "--initial-peers", founder.address)
    outsider = crowdtrain("run", "--state-dir", str(tmp_path / "outsider"), *nodes)
    assert outsider.returncode == 3, outsider.stderr
    assert "invite-only run needs --join-token" in outsider.stderr
    assert "Traceback" not in outsider.stderr
    reader = crowdtrain("status", "--json", "--bootstrap-timeout", "5", "--initial-peers", founder.address)
    assert reader.returncode == 3 and "Traceback" not in reader.stderr
    forged = issue_join_token("tiny", RSAPrivateKey(), 3600)
    forger = crowdtrain("run", "--state-dir", str(tmp_path / "forger"), *nodes, "--join-token", forged)
    assert forger.returncode == 3, forger.stderr
    assert "that your join token is for the run there" in forger.stderr

    # The founder's token again: it admits one identity and the joiner used it first. The second identity finds that
    # out from the admission records it reads every 30 s: 150 s leave room for reads that fail under load.
    second = crowdtrain(
        "run", "--state-dir", str(tmp_path / "second"), *nodes, env={"CROWDTRAIN_JOIN_TOKEN": token}, timeout_s=150
    )
    assert second.returncode == 2, second.stderr
    assert "Traceback" not in second.stderr
    assert f"admits 1 identity and 1 used it first ({joiner.peer_id})" in second.stderr.splitlines()[-1]
    await_condition(
        lambda: "its join token (label 'alice') admits 1 identity" in founder.log(), 60, "the founder to refuse it"
    )
    assert joiner.log().count("refusing peer") <= 1  # once per peer, however often the records are read

    # The founder revokes alice's token: its daemon publishes the signed list, every node reads it, and the joiner
    # stops with one sentence while the founder refuses it.
    revoked = crowdtrain("invite", "--state-dir", str(tmp_path / "founder"), "--revoke", "alice")
    assert revoked.returncode == 0, revoked.stderr
    assert joiner.process.wait(timeout=150) == 2, joiner.log()[-3000:]
    assert "This node is no longer admitted: the founder revoked its join token (label 'alice')" in joiner.log()
    await_condition(
        lambda: "the founder revoked its join token (label 'alice')" in founder.log(), 60, "the founder to refuse it"
    )
    assert "heartbeat failed" not in founder.log() + joiner.log()
