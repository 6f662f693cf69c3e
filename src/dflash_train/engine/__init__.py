"""The target on a serving engine: vLLM computes the target's hidden states for training.

Two sides, two Python environments:
- the engine process (`server.py`, `connector.py`), run in vLLM's own environment: vLLM, its
  torch, the standard library and this package's stdlib-only modules (`layers.py`,
  `protocol.py`, `jobs.py`, `dflash_train.faults`, `dflash_train.model.digest`); it never
  imports the rest of the project;
- the trainer's side (`process.py`: start, health, stop on every path; `source.py`: the
  `FeatureSource` target workers call; the cached vLLM environment is `bench/engine.py`'s),
  in this project's environment.

This file imports nothing: vLLM imports `dflash_train.engine.connector` by module path
(`kv_connector_module_path`) inside its own environment.
"""
