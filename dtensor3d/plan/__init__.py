"""Planning: what a run will cost, without running it.

`report.py` prints `plan` (the rank layout, memory, FLOPs, bytes per collective, bubble);
`estimate.py` is the cost model, `shapes.py` the model's parameter table,
`schedule_model.py` each pipeline schedule's stages per rank and microbatches in flight,
`simulate.py` one rank under a fake process group (`plan --simulate`), `activations.py`
the activation-memory measurement the tests and bench compare against; `perf.py` and
`perf_compute.py` the performance model on `hardware.py`'s devices (`plan --hardware`),
`reshard.py` the `fsdp_reshard_after_forward: auto` rule. Everything but `simulate.py` and
`activations.py` is pure Python (no torch); imports config and mesh.
"""
