"""The generate rows of bench/peers.py (issue 25): greedy tokens/s after start-up and a whole
one-token process, dtensor3d against transformers on the same checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from common import ROOT, line

PROMPT = "The quick brown fox jumps over"
HF_ONE_TOKEN = (
    "import sys, torch; from transformers import LlamaForCausalLM; "
    "m = LlamaForCausalLM.from_pretrained(sys.argv[1]); "
    "print(m.generate(torch.tensor([list(range(1, 31))]), max_new_tokens=1, do_sample=False)[0, -1].item())"
)


def generate_speeds(ckpt: str, new: int) -> tuple[float, float]:
    """(dtensor3d, transformers) greedy tokens/s after start-up, one thread, same prompt ids."""
    import torch
    from transformers import LlamaForCausalLM

    from dtensor3d.checkpoint.hf import model_from, model_source
    from dtensor3d.generate import generate_ids

    torch.set_num_threads(1)
    prompt = list(range(1, len(PROMPT) + 1))
    ours_model = model_from(*model_source(ckpt, "generate"))
    hf = LlamaForCausalLM.from_pretrained(ckpt).eval()
    start = time.perf_counter()
    got = list(generate_ids(ours_model, prompt, new, temperature=0.0))
    ours_s = time.perf_counter() - start
    start = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False)
    hf_s = time.perf_counter() - start
    assert len(got) == out.shape[1] - len(prompt) == new
    return new / ours_s, new / hf_s


def one_token_seconds(ckpt: str) -> tuple[float, float]:
    """Wall seconds of a whole process making one token: dtensor3d generate vs transformers."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    ours_cmd = [sys.executable, "-m", "dtensor3d", "generate", ckpt, "--prompt", PROMPT]
    ours_cmd += ["--max-new-tokens", "1", "--temperature", "0"]
    times = []
    for cmd in (ours_cmd, [sys.executable, "-c", HF_ONE_TOKEN, ckpt]):
        start = time.perf_counter()
        subprocess.run(cmd, env=env, check=True, capture_output=True, cwd=ROOT)
        times.append(time.perf_counter() - start)
    return times[0], times[1]


def generate_rows(args, ckpt: str) -> None:
    """generate's tokens/s after start-up and a whole one-token process, against transformers'."""
    speeds, procs = ([], []), ([], [])
    for _ in range(args.rounds):
        for acc, got in ((speeds, generate_speeds(ckpt, 8 if args.quick else 64)), (procs, one_token_seconds(ckpt))):
            acc[0].append(got[0])
            acc[1].append(got[1])
    print(line("generate (after start-up)", "transformers generate", *speeds, "tok/s"), flush=True)
    print(line("one-token process", "transformers process", *procs, "s", higher=False), flush=True)
