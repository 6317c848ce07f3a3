"""SkipPipe's roster: who serves which stage, the leader's rosters, the schedule of paths.

declaration        the stage a node takes and declares, with what its device, memory and link take per microbatch
rostering          a node's place in the roster: its first iteration, the leader's rosters, moves between stages,
                   stage 0 founded again
membership         stage declarations and the leader's rosters in the DHT
costs              what a node's visit costs the scheduler: link seconds per hop, declared compute bounded
schedule           each microbatch's path through the stages (skips, reorders, load-aware replicas), from the roster
"""
