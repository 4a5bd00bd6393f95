"""Dtensor3dLM: lm-evaluation-harness's model class over dtensor3d's single-device model
(see the package docstring); importing this module registers it as `dtensor3d`."""

from __future__ import annotations

import os
import tempfile

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from ..errors import DataError, RecipeError


def hf_tokenizer(ckpt: str):
    """transformers' tokenizer of CKPT: a Hugging Face directory's own, else the checkpoint's
    tokenizer.json (in the step directory or beside it) as export-hf would write it."""
    from transformers import AutoTokenizer

    from ..datasets.tokenizer import write_hf_tokenizer
    from ..generate import find_tokenizer

    if os.path.isfile(os.path.join(ckpt, "config.json")) and os.path.isfile(os.path.join(ckpt, "tokenizer.json")):
        return AutoTokenizer.from_pretrained(ckpt)
    try:
        path = find_tokenizer(ckpt, None)
    except DataError:
        raise DataError(
            f"eval: CKPT={ckpt!r} has no tokenizer.json in or beside it; the harness needs the checkpoint's "
            "tokenizer (a checkpoint trained on prepared data or imported with import-hf carries one)"
        ) from None
    with tempfile.TemporaryDirectory() as tmp:
        write_hf_tokenizer(path, tmp)
        return AutoTokenizer.from_pretrained(tmp)


class Dtensor3dLM(TemplateLM):
    """lm_eval's model interface on a dtensor3d single-device model (see the module docstring)."""

    def __init__(self, pretrained=None, model=None, tokenizer=None, batch_size=8, max_length=None, runner=None, **_):
        super().__init__()
        if model is None and runner is None:
            from ..checkpoint.hf import model_from, model_source

            cfg, files = model_source(str(pretrained), "eval")
            model, max_length = model_from(cfg, files), max_length or cfg.max_position_embeddings
        self.runner = runner or LocalRunner(model)
        self.model, self.tokenizer = self.runner.model, tokenizer or hf_tokenizer(str(pretrained))
        self.batch_size = int(batch_size)
        self.max_length = int(max_length or self.model.cfg.max_position_embeddings)
        self.max_gen_toks = 256
        self._rank, self._world_size = self.runner.rank, self.runner.world_size

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def device(self) -> str:
        return "cpu"  # the single-device model loads on the CPU (checkpoint.hf.model_from)

    def all_gather(self, tensor):
        """The ranks' tensors, stacked (0-d) or concatenated (as accelerate's gather), on every rank."""
        import torch
        import torch.distributed as dist

        if self.world_size == 1:
            return tensor
        parts = [torch.zeros_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor, group=self.runner.group)
        return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)

    def gather_object(self, obj, dst=0):
        import torch.distributed as dist

        if self.world_size == 1:
            return [obj]
        out = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, out, group=self.runner.group, group_dst=dst)
        return out

    def barrier(self) -> None:
        import torch.distributed as dist

        if self.world_size > 1:
            dist.barrier(group=self.runner.group)

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens=None, left_truncate_len=None, **kwargs) -> list[int]:
        extra = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        ids = self.tokenizer.encode(string, **extra)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        out = super().loglikelihood(requests, disable_tqdm)
        self.runner.drain()  # in the loop: the forwards of ranks with more requests
        return out

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(sum of the continuation's log-probabilities, whether it is the greedy one) per
        request, in the requests' order; longest first in batches of batch_size."""
        rows = [((ctx + cont)[-(self.max_length + 1) :][:-1], cont) for _, ctx, cont in requests]
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        out: list = [None] * len(rows)
        for start in range(0, len(order), self.batch_size):
            batch = order[start : start + self.batch_size]
            for i, result in zip(batch, self._score([rows[i] for i in batch]), strict=True):
                out[i] = result
                if self.cache_hook is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], result)
        return out

    def _score(self, rows) -> list[tuple[float, bool]]:
        import torch
        import torch.nn.functional as F

        width = max(len(inp) for inp, _ in rows)
        pad = self.eot_token_id or 0
        ids = torch.tensor([inp + [pad] * (width - len(inp)) for inp, _ in rows])
        logp = F.log_softmax(self.runner.logits(ids), dim=-1)
        results = []
        for k, (inp, cont) in enumerate(rows):
            span = logp[k, len(inp) - len(cont) : len(inp)]
            target = torch.tensor(cont)
            greedy = bool((span.argmax(-1) == target).all())
            results.append((float(span.gather(1, target[:, None]).sum()), greedy))
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's total log-probability over disjoint windows of max_length tokens (HFLM's split)."""
        from lm_eval import utils

        counts, windows = [], []
        for req in requests:
            found = utils.get_rolling_token_windows(
                token_list=self.tok_encode(req.args[0]),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            found = [(None, *utils.make_disjoint_window(w)) for w in found]
            counts.append(len(found))
            windows += found
        scores = [score for score, _ in self._loglikelihood_tokens(windows)]  # every window batched together
        out, start = [], 0
        for req, n in zip(requests, counts, strict=True):
            out.append(sum(scores[start : start + n]))
            start += n
            if self.cache_hook is not None:
                self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), out[-1])
        self.runner.drain()
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, cut at the first stop sequence (HFLM's rules), batch_size
        requests of the same stop strings and length at a time with a KV cache (`_greedy`)."""
        from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

        eos = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        jobs = []  # (prompt, max_new, until) per request
        for req in requests:
            context, gen_kwargs = req.args
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
            if kwargs.get("do_sample") or kwargs.get("temperature", 0.0) > 0:
                raise RecipeError(f"eval: only greedy generation is supported (got {gen_kwargs})")
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_new = kwargs.pop("max_gen_toks")
            jobs.append((self.tok_encode(context, left_truncate_len=self.max_length - max_new), max_new, until))
        tokens = self._greedy(jobs)
        out = []
        for req, (_, _, until), toks in zip(requests, jobs, tokens, strict=True):
            text = postprocess_generated_text(generation=self.tok_decode(toks), stop=until, think_end_token=None)
            out.append(text)
            if self.cache_hook is not None:
                self.cache_hook.add_partial("generate_until", req.args, text)
        self.runner.drain()
        return out

    def _greedy(self, jobs: list) -> list[list[int]]:
        """Greedy tokens of every job, each cut after the first stop string: the jobs of the
        same length and stop strings together, longest prompt first, batch_size per batch
        (generate.greedy_batch: left-padded, one KV cache per batch)."""
        from ..generate import greedy_batch

        out: list = [None] * len(jobs)
        groups: dict = {}
        for i, (_, max_new, until) in enumerate(jobs):
            groups.setdefault((max_new, tuple(until)), []).append(i)
        for (max_new, until), members in groups.items():
            members.sort(key=lambda i: -len(jobs[i][0]))
            for start in range(0, len(members), self.batch_size):
                batch = members[start : start + self.batch_size]

                def done(k, tokens, until=until):
                    return any(stop in self.tok_decode(tokens) for stop in until)

                prompts = [jobs[i][0] for i in batch]
                found = greedy_batch(self.runner.step, self.runner.new_cache, prompts, max_new, done)
                for i, tokens in zip(batch, found, strict=True):
                    out[i] = tokens
        return out


register_model("dtensor3d")(Dtensor3dLM)


class LocalRunner:
    """The model whole in this process: the logits of a batch, and the harness's ranks as the
    default group's (each rank scores its share of the requests)."""

    def __init__(self, model):
        self.model, self.group = model, None
        self.rank, self.world_size = _dist_rank_world()

    def logits(self, ids):
        import torch

        from ..generate import _drop_moe_records

        with torch.no_grad():
            out = self.model(ids).float()
        _drop_moe_records(self.model)
        return out

    def step(self, ids, cache):
        """The last position's logits [b, vocab] of `ids` after the tokens in `cache` (generation)."""
        import torch

        from ..generate import _drop_moe_records

        with torch.no_grad():
            out = self.model(ids, cache)[:, -1].float()
        _drop_moe_records(self.model)
        return out

    def new_cache(self, pad):
        from ..models.layers import KVCache

        return KVCache(pad)

    def drain(self) -> None:
        pass


def _dist_rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
