"""Serving peers: what every crowdtrain RPC service is built on.

service    P2PService: the base of every crowdtrain RPC service, on its own event loop, gated in invite-only runs
bulk       admission for answers that move bulk data: concurrency per peer and in all, memory, a deadline
"""
