"""Mixture-of-experts checkpoints: an expert-parallel run resumes at another mesh, and the
model goes to and from transformers' MixtralForCausalLM with the same logits."""

import pytest
import torch
import transformers
from helpers import ROOT, TINY_HF_LLAMA, cli_process, train_metrics
from safetensors.torch import load_file

from dtensor3d.checkpoint import load_model

MOE = str(ROOT / "tests" / "recipes" / "moe_parity.yaml")
# rope_theta not the default 10000 (a mapping that lost it would fall back to that).
MIXTRAL = dict(
    TINY_HF_LLAMA, num_local_experts=8, num_experts_per_tok=2, router_aux_loss_coef=0.01, rope_theta=250000.0
)


def tokens(seed=0):
    return torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(seed))


def logits_of(model, x):
    with torch.no_grad():
        out = model(x)
    return out.logits if hasattr(out, "logits") else out


@pytest.fixture(scope="module")
def ep_run(tmp_path_factory):
    """ep2 x dp2 (experts split over ep, FSDP2 over ep x dp for the rest), 6 steps, checkpoint at 3 and 6.
    Its step 4 against one process's from the same state (test_ep_checkpoint_resumes_at_one_process)
    sees expert gradients at 2x (pytorch #160285) and the aux gradient divided by dp (NeMo
    Automodel #1412) in grad_norm."""
    root = tmp_path_factory.mktemp("ep")
    records = train_metrics(
        root / "run",
        4,
        [
            "parallelism.ep=2",
            "parallelism.dp=2",
            "training.steps=6",
            f"checkpoint.dir={root / 'ck'}",
            "checkpoint.interval=3",
        ],
        MOE,
    )
    return records, root


def test_ep_checkpoint_resumes_at_one_process(ep_run, tmp_path):
    records, root = ep_run
    resumed = train_metrics(
        tmp_path / "run",
        1,
        ["training.steps=6", f"checkpoint.dir={tmp_path / 'ck'}", f"checkpoint.resume={root / 'ck' / 'step_00000003'}"],
        MOE,
    )
    assert [r["step"] for r in resumed] == [4, 5, 6]
    for got, ref in zip(resumed, records[3:]):
        for key in ("loss", "grad_norm", "aux_loss"):
            assert abs(got[key] - ref[key]) <= 1e-5 * abs(ref[key]), (key, got, ref)
        assert got["tokens_per_expert"] == ref["tokens_per_expert"]


def test_export_to_mixtral(ep_run, tmp_path):
    _, root = ep_run
    out = tmp_path / "hf"
    proc = cli_process("export-hf", str(root / "ck"), str(out))
    assert proc.returncode == 0, proc.stderr
    hf, info = transformers.MixtralForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    hf = hf.float().eval()
    ours = load_model(root / "ck")
    x = tokens()
    assert (logits_of(hf, x) - logits_of(ours, x)).abs().max().item() <= 1e-5
    names = load_file(out / "model.safetensors")
    assert names["model.layers.0.block_sparse_moe.experts.7.w2.weight"].shape == (64, 128)  # [hidden, inter]


def test_import_from_mixtral(tmp_path):
    torch.manual_seed(0)
    hf = transformers.MixtralForCausalLM(transformers.MixtralConfig(**MIXTRAL)).float().eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf.save_pretrained(tmp_path / "hf")
    x = tokens(1)
    ref = logits_of(hf, x)
    assert (logits_of(load_model(tmp_path / "hf"), x) - ref).abs().max().item() <= 1e-5
    proc = cli_process("import-hf", str(tmp_path / "hf"), str(tmp_path / "ck"))
    assert proc.returncode == 0, proc.stderr
    assert (logits_of(load_model(tmp_path / "ck"), x) - ref).abs().max().item() <= 1e-5
    # And back: export of the import gives Mixtral's tensors bit for bit.
    assert cli_process("export-hf", str(tmp_path / "ck"), str(tmp_path / "back")).returncode == 0
    a, b = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
