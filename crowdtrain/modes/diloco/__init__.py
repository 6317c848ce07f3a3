"""DiLoCo: H inner steps alone, then pseudo-gradients averaged and one outer Nesterov step.

mode              DiLoCoMode: inner steps, outer rounds, the state it serves
joining           how a peer keeps to the swarm's rounds: state downloads, catching up, resyncing (a mixin)
overlap           a round averaged in the background while the next one's inner steps go on (a mixin)
internals         what the mixins see of the mode (a Protocol)
pseudo_gradients  the outer round's averager: pseudo-gradients averaged, the outer state served to joiners
adaptive_h        the round's inner steps agreed from every peer's proposal (a sync budget per round)
fragments         Streaming DiLoCo: the parameters cut into fragments of consecutive layers, synced in turn

May import: `averaging`, `models`, `data`, `dht`, `manifest`, `optimizer`, `proto`, `errors`, and `modes.base`.
"""
