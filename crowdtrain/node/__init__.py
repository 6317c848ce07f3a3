"""The daemon and its command line.

cli         `crowdtrain run|status`: flags, signals, exit codes
config      NodeConfig and StatusConfig, layered from flags, env, TOML and defaults
daemon      the node's lifecycle and its heartbeat in the DHT
membership  found a run or join the swarm's run
status      the status reader: collect, summarise, render, watch
identity    the persistent key file and peer ID
statedir    the state-dir lock and node.json
addresses   listen addresses, port checks, the address to share
device      the training device and its description
logs        text or JSON log lines, hivemind's chatter below -v
"""
