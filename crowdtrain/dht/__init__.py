"""The run's schema on top of hivemind.DHT.

keys       key names of every record crowdtrain stores
records    encode, sign, decode and verify records (manifests, peer statuses)
bounds     the bounds crowdtrain.proto writes beside record fields, checked in one pass
validator  the DHT record validator: parses every value, caps sizes, rejects forgeries
registry   read and write the run's records: manifests, peer statuses, admission records, revocations
swarm      join the DHT (server or client) with bounded time and plain errors
calls      calls into the DHT process from our threads: bounded, every failure one ordinary exception
admission  invite-only runs: join tokens, and the access check on every DHT request
invites    a join token's identity limit and the founder's signed revocations, decided alike by every node
gate       which peers may call our RPCs (valid published access tokens, within limits, not revoked), asked
           before every handler of a gated servicer, in this process and the averagers it forks
frames     the cap on every stream frame a peer can make this process read
"""
