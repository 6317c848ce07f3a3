"""crowdtrain: a peer-to-peer volunteer training daemon built on hivemind.

Package map, from the top down; a package may import only those below it (tests/test_layers.py):
  cli/        the command line: `run`, `status`, `check`; flags, exit codes, rendering of reports
  node/       the daemon's lifecycle: config, identity, state dir, join, heartbeats, leave
  training/   the training loop (the same for every mode), checkpoints, held-out scoring, the throughput probe
  modes/      the training modes behind one interface, each in its own module or sub-package, and their registry:
              gradients and parameters (collaborative), diloco/, spes/, skippipe/
  planning/   the DeDLOC plan and this node's roles from measured capabilities
  collaboration/  hivemind.Optimizer for the run: built from the manifest, its workarounds and catch-up holds
  links/      measuring links: bandwidth and reachability probes
  averaging/  all-reduce machinery: Moshpit groups, plan-partitioned rounds, exactness, phases, traffic
  state/      the verified state transfer: a state downloaded from peers, checked, corroborated; catch-up holds
  moe/        DMoE expert hosting: placement, replicas, the host's supervisor
  rpc/        serving peers: the base of every RPC service, admission of bulk answers (memory, concurrency, time)
  models/     model builders from a manifest, precision, the training device
  data/       datasets: the embedded corpus, local files, HF datasets; per-peer sampling
  optimizer   the one optimizer factory: every mode's optimizer, schedule and gradient clipping
  dht/        the run's DHT schema: key names, record codecs, validators, bootstrap
  codecs/     tensor encodings on the wire by name (fp16, int8, topk, none), blockwise int8, top-k error feedback
  manifest/   the run manifest: what a run trains, on what, and how (sections, presets, run files)
  structured  typed parsing of mappings (TOML, env) and protobuf messages into frozen dataclasses
  roles       Role: what a node does for its run (trainer, aggregator, expert-host, client)
  proto/      protobuf records stored in the DHT and the node's own RPC messages
  errors      exceptions that carry the CLI's exit code
  files       files kept across restarts: atomic writes, SHA-256 checksums beside them
  forking     forked processes never garbage-collect their parent's shared tensors (installed on import)
See ARCHITECTURE.md for how a global step flows through them.
"""

from crowdtrain import forking as _forking

__version__ = "0.1.0"

_forking.install()
