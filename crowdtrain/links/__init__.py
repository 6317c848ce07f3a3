"""Measuring links between peers: upload and download bandwidth, and whether peers can dial a node back.

probes  the probe RPCs on hivemind's P2P layer: wire protocol, server, rate limiter, client, reachability

May import: `dht`, `proto`, `errors`.
"""
