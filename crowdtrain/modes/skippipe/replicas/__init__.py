"""SkipPipe's replicas: what a stage's replicas share (the summed gradient, the state) and whether they drifted.

gradient_exchange  the stage's gradient summed over its replicas, in the background with overlap_exchange
stage_state        the stage's parameters and AdamW moments: taken from a replica, served, kept beside a look-ahead
drift              fingerprints of the replicas' parameters, and whether the replicas drifted apart
"""
