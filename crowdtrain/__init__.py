"""crowdtrain: a peer-to-peer volunteer training daemon built on hivemind.

Package map:
  proto/      protobuf records stored in the DHT
  dht/        the run's DHT schema: key names, record codecs, validators, bootstrap
  node/       the daemon and its CLI: config, identity, lifecycle, status
  manifest    the run manifest: what a run trains, on what, and how (types, presets, TOML)
  structured  typed parsing of mappings (TOML, env) and protobuf messages into frozen dataclasses
  errors      exceptions that carry the CLI's exit code
"""

__version__ = "0.1.0"
