"""The daemon's lifecycle: config, identity, state dir, start, join, heartbeats, leave.

config       NodeConfig, StatusConfig and CheckConfig, layered from flags, env, TOML and defaults
daemon       the node's lifecycle and its heartbeat in the DHT
membership   found a run or join the swarm's run
admission_watch  an invite-only run's admission, kept up by the heartbeat: own record, standing, revocations
identity     the persistent key file and peer ID
statedir     the state-dir lock and node.json
addresses    listen addresses, port checks, the address to share
expert_host  the expert-host role: an ExpertSupervisor configured from the node's settings
metrics      the local Prometheus endpoint (metrics_port, 127.0.0.1 only)
logs         text or JSON log lines, hivemind's chatter below -v

May import: `training`, `planning`, `links`, `averaging`, `moe`, `models`, `data`, `dht`, `manifest`,
`structured`, `proto`, `errors`; never `cli`.
"""
