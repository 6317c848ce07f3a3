"""DiLoCo: H inner steps alone, then pseudo-gradients averaged and one outer Nesterov step.

mode              DiLoCoMode: inner steps, outer rounds, joining and catching up
pseudo_gradients  the outer round's averager: pseudo-gradients averaged, the outer state served to joiners
adaptive_h        the round's inner steps agreed from every peer's proposal (a sync budget per round)
fragments         Streaming DiLoCo: the parameters cut into fragments of consecutive layers, synced in turn

May import: `averaging`, `models`, `data`, `dht`, `manifest`, `optimizer`, `proto`, `errors`, and `modes.base`.
"""
