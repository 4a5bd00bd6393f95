"""eval: lm-evaluation-harness through dtensor3d's model class equals lm_eval's own HFLM on the
export-hf of the same checkpoint (every request's loglikelihood, every greedy generation, every
metric), on the local tasks of tests/eval/tasks; the command's door errors are one line each."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from dtensor3d.__main__ import main
from dtensor3d.datasets.tokenizer import byte_tokenizer, write_hf_tokenizer

lm_eval = pytest.importorskip("lm_eval")
transformers = pytest.importorskip("transformers")

TASKS_DIR = str(Path(__file__).parents[1] / "eval" / "tasks")
TASKS = ["d3d_doc_mc", "d3d_doc_ppl", "d3d_doc_gen"]
LIMIT = 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A random tiny HF Llama with a byte tokenizer -> import-hf (ck) -> export-hf (export)."""
    root = tmp_path_factory.mktemp("eval")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=264, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip
    hf = transformers.LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # logits far apart: no near-ties for argmax
    hf.save_pretrained(root / "hf")
    byte_tokenizer().save(str(root / "tok.json"))
    write_hf_tokenizer(str(root / "tok.json"), str(root / "hf"))
    assert main(["import-hf", str(root / "hf"), str(root / "ck")]) == 0
    assert main(["export-hf", str(root / "ck"), str(root / "export")]) == 0
    return root


def _run(lm, batch_size=4):
    from dtensor3d.harness import evaluate, task_manager

    start = time.perf_counter()
    out = evaluate(lm, TASKS, task_manager(TASKS_DIR, TASKS), limit=LIMIT, log_samples=True)
    return out, time.perf_counter() - start


def _responses(results) -> dict:
    """task -> per document, per request: the model's raw answer (loglikelihood, flag or text)."""
    return {t: [s["resps"] for s in sorted(ss, key=lambda s: s["doc_id"])] for t, ss in results["samples"].items()}


def _compare(ours, theirs) -> tuple[int, float, float]:
    """(requests, max rel loglikelihood error, max rel metric error); generations, is-greedy
    flags and accuracies asserted identical on the way."""
    a, b = _responses(ours), _responses(theirs)
    assert a.keys() == b.keys() == set(TASKS)
    worst, requests = 0.0, 0
    for task in TASKS:
        for doc_a, doc_b in zip(a[task], b[task], strict=True):
            for ra, rb in zip(doc_a, doc_b, strict=True):
                requests += 1
                ra, rb = ra[0], rb[0]
                if isinstance(ra, str):
                    assert ra == rb, (task, ra, rb)  # greedy generations identical
                    continue
                ll_a, ll_b = (ra[0], rb[0]) if isinstance(ra, (tuple, list)) else (ra, rb)
                worst = max(worst, abs(ll_a - ll_b) / abs(ll_b))
                if isinstance(ra, (tuple, list)):
                    assert ra[1] == rb[1]  # is_greedy
    metric_worst = 0.0
    for task in TASKS:
        for metric, value in theirs["results"][task].items():
            if isinstance(value, float) and "_stderr" not in metric:
                mine = ours["results"][task][metric]
                if metric.startswith(("acc", "exact_match")):
                    assert mine == value, (task, metric, mine, value)  # counts of the same answers: exact
                metric_worst = max(metric_worst, abs(mine - value) / max(abs(value), 1e-300))
    return requests, worst, metric_worst


def test_equals_hflm_on_the_export(checkpoint):
    from lm_eval.models.huggingface import HFLM

    from dtensor3d.harness.lm import Dtensor3dLM

    ours, t_ours = _run(Dtensor3dLM(pretrained=str(checkpoint / "ck"), batch_size=4))
    theirs, t_hf = _run(HFLM(pretrained=str(checkpoint / "export"), dtype="float32", batch_size=4, device="cpu"))
    requests, worst, metric_worst = _compare(ours, theirs)
    assert worst <= 1e-5 and metric_worst <= 1e-5, (worst, metric_worst)  # perplexities: exps of the sums above
    print(
        f"\n{requests} requests: max rel loglikelihood error {worst:.2e}, max rel metric error {metric_worst:.2e}; "
        f"dtensor3d {t_ours:.2f} s, HFLM {t_hf:.2f} s"
    )


def test_eval_command_prints_the_table_and_writes_json(checkpoint, capsys):
    out = checkpoint / "results.json"
    argv = ["eval", str(checkpoint / "ck"), "--tasks", "d3d_doc_mc", "--include-path", TASKS_DIR, "--limit", "4"]
    assert main([*argv, "--output", str(out)]) == 0
    assert "d3d_doc_mc" in capsys.readouterr().out
    assert "acc,none" in json.loads(out.read_text())["results"]["d3d_doc_mc"]


@pytest.mark.parametrize(
    "case, needle",
    [
        ("unknown_task", "unknown task no_such_task"),
        ("missing_include", "--include-path="),
        ("no_tokenizer", "has no tokenizer.json"),
        ("pp_world", "--pp=2 must be >= 1 with tp x pp = 1 x 2 dividing the world size 1"),
        ("pp_layers", "--pp=4: more pipeline stages than the model's 2 layers"),
        ("tp_heads", "--tp=4: the model's 4 attention heads (2 key/value heads) do not split over tp; valid --tp: 1"),
    ],
)
def test_eval_door_errors(checkpoint, tmp_path, capsys, monkeypatch, case, needle):
    import shutil

    ckpt = str(checkpoint / "ck")
    tasks, include, extra = "d3d_doc_mc", TASKS_DIR, []
    if case.startswith("pp"):  # pp_layers: as a rank of a 4-process torchrun sees it (refused before any group forms)
        extra = ["--pp", "2" if case == "pp_world" else "4"]
        monkeypatch.setenv("WORLD_SIZE", "1" if case == "pp_world" else "4")
    elif case == "tp_heads":  # as a rank of a 4-process torchrun sees it: 2 key/value heads cannot split 4 ways
        extra = ["--tp", "4"]
        monkeypatch.setenv("WORLD_SIZE", "4")
    elif case == "unknown_task":
        tasks = "d3d_doc_mc,no_such_task"
    elif case == "missing_include":
        include = str(tmp_path / "nowhere")
    else:
        ckpt = str(tmp_path / "bare")
        shutil.copytree(checkpoint / "hf", ckpt, ignore=shutil.ignore_patterns("tokenizer*"))
    assert main(["eval", ckpt, "--tasks", tasks, "--include-path", include, *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and needle in err[0], err


def test_dp2_tp2_and_pp2_under_torchrun_equal_hflm(checkpoint):
    """4 ranks, `--tp 2`: the model sharded over dp 2 (FSDP) x tp 2 (every forward in lockstep),
    the dp ranks splitting the requests and rank 0 gathering; then 2 ranks, `--pp 2`: each rank
    builds and loads only its stage, the requests through the stages point to point
    (harness/stages.py). Each: every loglikelihood equal to lm-eval's own HFLM on the export
    within 1e-5, every greedy generation and accuracy identical."""
    from helpers import torchrun
    from lm_eval.models.huggingface import HFLM

    from dtensor3d.harness import evaluate, task_manager

    args = ["-m", "dtensor3d", "eval", str(checkpoint / "ck"), "--tasks", ",".join(TASKS), "--batch-size", "8"]
    args += ["--include-path", TASKS_DIR, "--limit", "6"]
    hf = HFLM(pretrained=str(checkpoint / "export"), dtype="float32", batch_size=8, device="cpu")
    theirs = evaluate(hf, TASKS, task_manager(TASKS_DIR, TASKS), limit=6, log_samples=True)
    for name, nproc, mesh in (("dp2 x tp2", 4, ["--tp", "2"]), ("pp2", 2, ["--pp", "2"])):
        out = checkpoint / f"{name.replace(' ', '')}.json"
        torchrun(nproc, [*args, *mesh, "--output", str(out)])
        requests, worst, metric_worst = _compare(json.loads(out.read_text()), theirs)
        print(f"\n{name}: {requests} requests, max rel loglikelihood error {worst:.2e}, metrics {metric_worst:.2e}")
        assert requests == 6 * 4 + 6 + 6 and worst <= 1e-5 and metric_worst <= 1e-5, (name, requests, worst)


def test_smollm2_equals_hflm_on_the_export(smollm2, tmp_path):
    """The real SmolLM2-135M weights and tokenizer: import-hf, export-hf, then the same tasks
    (4 documents each) through both backends."""
    from lm_eval.models.huggingface import HFLM

    from dtensor3d.harness import evaluate, task_manager
    from dtensor3d.harness.lm import Dtensor3dLM

    assert main(["import-hf", str(smollm2), str(tmp_path / "ck")]) == 0
    assert main(["export-hf", str(tmp_path / "ck"), str(tmp_path / "export")]) == 0
    lms = (
        Dtensor3dLM(pretrained=str(tmp_path / "ck"), batch_size=4),
        HFLM(pretrained=str(tmp_path / "export"), dtype="float32", batch_size=4, device="cpu"),
    )
    ours, theirs = (evaluate(lm, TASKS, task_manager(TASKS_DIR, TASKS), limit=4, log_samples=True) for lm in lms)
    requests, worst, metric_worst = _compare(ours, theirs)
    assert requests == 4 * 4 + 4 + 4 and worst <= 1e-5 and metric_worst <= 1e-5, (requests, worst, metric_worst)


def test_moe_family_equals_hflm_on_the_export(tmp_path):
    """A tiny random Qwen3-MoE (top-2 of 4 experts, one dense layer) from transformers' config
    class, through import-hf and export-hf: every loglikelihood of the local tasks within 1e-5 of
    HFLM on the export, every greedy generation and accuracy identical."""
    from lm_eval.models.huggingface import HFLM

    from dtensor3d.harness.lm import Dtensor3dLM

    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=264, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=40, mlp_only_layers=[1], tie_word_embeddings=False,
    )  # fmt: skip
    hf = transformers.Qwen3MoeForCausalLM(config).float().eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # logits far apart: no near-ties for argmax
    hf.save_pretrained(tmp_path / "hf")
    byte_tokenizer().save(str(tmp_path / "tok.json"))
    write_hf_tokenizer(str(tmp_path / "tok.json"), str(tmp_path / "hf"))
    assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "ck")]) == 0
    assert main(["export-hf", str(tmp_path / "ck"), str(tmp_path / "export")]) == 0
    ours, _ = _run(Dtensor3dLM(pretrained=str(tmp_path / "ck"), batch_size=4))
    theirs, _ = _run(HFLM(pretrained=str(tmp_path / "export"), dtype="float32", batch_size=4, device="cpu"))
    requests, worst, metric_worst = _compare(ours, theirs)
    print(f"\nqwen3_moe: {requests} requests, max rel loglikelihood error {worst:.2e}, metrics {metric_worst:.2e}")
    assert requests == LIMIT * 4 + LIMIT + LIMIT and worst <= 1e-5 and metric_worst <= 1e-5, (worst, metric_worst)


def test_batched_cached_generation_equals_one_prompt_at_a_time(checkpoint):
    """generate.greedy_batch on prompts of different lengths (left-padded, one KV cache, finished
    rows leaving the batch) against each prompt alone (no padding): every step's logits within
    1e-6 relative to the row's largest logit (float32 rounding: SDPA's masked kernel against its
    causal one) and every token identical."""
    from dtensor3d.checkpoint.hf import load_model
    from dtensor3d.generate import greedy_batch
    from dtensor3d.harness.lm import LocalRunner

    runner = LocalRunner(load_model(str(checkpoint / "ck")))
    torch.manual_seed(1)
    prompts = [torch.randint(0, 264, (n,)).tolist() for n in (9, 3, 17, 1)]
    lengths = {0: 6, 1: 2, 2: 6, 3: 4}  # rows 1 and 3 finish early and leave the cache

    def recording(logs):
        def step(ids, cache):
            out = runner.step(ids, cache)
            logs.append(out)
            return out

        return step

    batched: list = []
    found = greedy_batch(recording(batched), runner.new_cache, prompts, 6, lambda i, t: len(t) >= lengths[i])
    live, worst = list(range(len(prompts))), 0.0
    for i, prompt in enumerate(prompts):
        alone: list = []
        assert greedy_batch(
            recording(alone), runner.new_cache, [prompt], 6, lambda _, t, i=i: len(t) >= lengths[i]
        ) == [found[i]]
        for t, logits in enumerate(alone):
            row = [j for j in live if lengths[j] > t].index(i)
            scale = float(logits[0].abs().max())
            worst = max(worst, float((batched[t][row] - logits[0]).abs().max()) / scale)
    print(f"\nbatched vs one at a time: max logit difference {worst:.2e} of the row's largest logit")
    assert [len(t) for t in found] == [6, 2, 6, 4] and worst <= 1e-6, worst


def test_the_task_index_is_the_include_path_alone_when_it_holds_every_task():
    """lm-eval's own ~7 s index is built only when a task named is not a plain task of
    --include-path (here: one of lm-eval's own; the unknown-task door case takes that way too)."""
    from dtensor3d.harness import task_manager

    assert sorted(task_manager(TASKS_DIR, TASKS).all_tasks) == sorted(TASKS)
    assert {"arc_easy", *TASKS} <= set(task_manager(TASKS_DIR, ["arc_easy", "d3d_doc_mc"]).all_tasks)
