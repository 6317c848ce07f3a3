"""hivemind.Optimizer for this run: built from the manifest on averaging's rounds and state's verified transfer.

factory             make_optimizer from the run manifest; helpers over the built optimizer (gradients, plan shares)
hivemind_optimizer  hivemind.Optimizer and its averagers subclassed: workarounds, phases, verified state, catch-up holds

May import: `averaging`, `state`, `dht`, `optimizer`, `manifest`, `proto`, `errors`.
"""
