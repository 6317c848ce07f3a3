"""The daemon and its command line.

cli         `crowdtrain run|status|check`: flags, signals, exit codes
config      NodeConfig, StatusConfig and CheckConfig, layered from flags, env, TOML and defaults
daemon      the node's lifecycle and its heartbeat in the DHT
metrics     the local Prometheus endpoint (metrics_port, 127.0.0.1 only)
membership  found a run or join the swarm's run
status      the status reader: collect, summarise, render, watch
roles       this node's measurements, its part of the DeDLOC plan, and re-probing its links
probes      the probe RPCs: bandwidth up/down and dial-back reachability, rate-limited
throughput  the throughput probe: samples/s of the run's model here, cached
check       `crowdtrain check`: the volunteer's pre-flight
identity    the persistent key file and peer ID
statedir    the state-dir lock and node.json
addresses   listen addresses, port checks, the address to share
device      the training device and its description
logs        text or JSON log lines, hivemind's chatter below -v
"""
