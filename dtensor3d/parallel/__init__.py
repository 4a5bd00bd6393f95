"""Parallelism applied from outside the single-device model.

`parallelize.py` is the one ordered entry point (pipeline split -> tp -> cp -> ep ->
recompute -> compile -> fsdp); each dimension owns its whole story in one file: `tensor.py`
(tp: the plan as a table), `context.py` (cp: attention over the cp group, batch sharding),
`expert.py` (ep: token dispatch), `data.py` (dp: FSDP2 / HSDP / replicate, gradient sync),
`pipeline.py` (pp: stages and schedules). `shards.py` turns a full tensor into this rank's
piece, `comm.py` counts collective bytes, `compile.py` wraps torch.compile. May import
config, mesh and models; never the training loop.
"""
