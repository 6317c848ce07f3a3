"""The run's schema on top of hivemind.DHT.

keys       key names of every record crowdtrain stores
records    encode, sign, decode and verify records (manifests, peer statuses)
validator  the DHT record validator: parses every value, caps sizes, rejects forgeries
registry   read and write the run's records: manifests and peer statuses
swarm      join the DHT (server or client) with bounded time and plain errors
"""
