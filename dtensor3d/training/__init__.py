"""Training: a validated recipe becomes a running job on this rank.

`train.py`: setup -> `TrainState`, `train_step(state, batch) -> metrics` and the loop;
`optim.py`: AdamW and the LR schedule; `evaluate.py`: validation loss at every mesh;
`metrics.py`: metrics.jsonl, TensorBoard, loss.svg, the console; `profiling.py`:
torch.profiler traces; `hooks.py`: the loop's cross-step concerns as step hooks (layout
probe, profiling, evaluation, metrics log, checkpoints); `faults.py`: preemption,
non-finite steps and collective timeouts. May import config, mesh, models, parallel,
datasets and checkpoint; nothing imports it but `__main__`.
"""
