"""How the commands that only read a swarm (`status`, `check`, `eval --initial-peers`) join it: a client-mode DHT
node with a throwaway key, admitted to an invite-only run by the reader's join token."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from hivemind.utils.crypto import RSAPrivateKey

from crowdtrain.dht.swarm import SupervisedDHT, SwarmOptions, join_swarm
from crowdtrain.dht.validator import make_validators
from crowdtrain.node.config import SwarmSettings
from crowdtrain.node.membership import reader_authorizer


def join_as_reader(
    settings: SwarmSettings,
    *,
    run_ids: Iterable[str] = (),
    listen: tuple[str, ...] | None = None,
    announce: tuple[str, ...] = (),
) -> tuple[SupervisedDHT, RSAPrivateKey]:
    """A DHT node that reads `settings`' swarm: never announced, never stores records nor answers DHT queries, so
    never counted as a peer; with its key (the owner of whatever it signs). `settings` has had `with_join_token`."""
    key = RSAPrivateKey()
    options = SwarmOptions(
        initial_peers=settings.initial_peers,
        announce=announce,
        client_mode=True,
        bootstrap_timeout_s=settings.bootstrap_timeout_s,
        authorizer=reader_authorizer(settings, key),
    )
    if listen is not None:
        options = dataclasses.replace(options, listen=listen)
    return join_swarm(options, make_validators(key, run_ids)), key
