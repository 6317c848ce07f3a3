"""Measuring links between peers: upload and download bandwidth, and whether peers can dial a node back.

protocol      the probe protocol's constants and results (BandwidthSample, AddressVerdict, ProbeReport)
limiter       the server's rate limiter: one probe per direction at a time, per-peer byte budgets, refusals
reachability  which announced addresses a server may dial back, and the verdict from the attempts
probes        ProbeService: the three probe RPCs served, and `measure` asking peers to probe this node
observations  the rates at which peers' probe streams reached this node: lower bounds of their uploads

May import: `dht`, `proto`, `errors`.
"""
