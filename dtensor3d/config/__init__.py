"""Configuration: what a run is, before anything runs.

`schema.py` holds the recipe (frozen dataclasses: model, parallelism, training, optimizer,
data, checkpoint, logging), its loading from YAML plus `key.path=value` overrides, every
check that needs only the recipe and the world size, and the named facts about the mesh
(`ParallelismConfig.fsdp_enabled`, `batch_ranks`, ...: `parallelism.py`, re-exported). `nanotron.py` turns a nanotron
config into recipe fields (`nanotron_keys.py`: its keys, their fate, the
overrides' two spellings). Nothing here imports torch (launch.sh validates before torchrun),
and this package imports nothing of dtensor3d but `errors`.
"""
