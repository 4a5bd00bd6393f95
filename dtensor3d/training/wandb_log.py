"""logging.wandb: Weights & Biases beside TensorBoard, written by rank 0 only (MetricsLog owns it).

Every scalar that goes to TensorBoard goes to W&B under the same tag at the same step; the
resolved recipe is the run's config; the run dir's loss.svg is saved into the run at the end.
The run's id is kept in the checkpoint (state.json's `wandb_id`): a resumed run passes it back
to `wandb.init(id=..., resume="allow")` and continues the same W&B run. `mode: offline` writes
the run under WANDB_DIR (default: the run dir) for `wandb sync` later, with no network.
"""

from __future__ import annotations

import os
import uuid


class WandbRun:
    """One W&B run for one training run (rank 0)."""

    def __init__(self, recipe, run_id: str | None):
        import wandb

        w = dict(recipe.logging.wandb)
        self.run = wandb.init(
            project=w.get("project"),
            entity=w.get("entity"),
            name=w.get("name"),
            tags=w.get("tags"),
            mode=w.get("mode", "online"),
            id=run_id or uuid.uuid4().hex[:8],  # a fresh run's id (W&B's ids are short strings)
            resume="allow",
            config=recipe.to_dict(),
            dir=os.environ.get("WANDB_DIR") or recipe.logging.run_dir,
        )
        self.id = self.run.id

    def log(self, scalars: list[tuple[str, float]], step: int) -> None:
        if scalars:
            self.run.log(dict(scalars), step=step)

    def finish(self, svg_path: str | None) -> None:
        """loss.svg into the run (its files), then close it."""
        if svg_path and os.path.exists(svg_path):
            self.run.save(svg_path, base_path=os.path.dirname(svg_path), policy="now")
        self.run.finish()
