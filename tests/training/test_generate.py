"""generate: the KV cache gives the full forward's logits; greedy tokens equal transformers'
generate(do_sample=False) on the export (Llama and Mixtral); the command streams text."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from helpers import ROOT

from dtensor3d.__main__ import main
from dtensor3d.checkpoint import load_model
from dtensor3d.datasets.tokenizer import byte_tokenizer
from dtensor3d.generate import TextStream, generate_ids, pick, prompt_ids, stop_ids, visible
from dtensor3d.models.layers import KVCache

transformers = pytest.importorskip("transformers")

BASE = dict(
    vocab_size=264,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    rope_theta=271828.0,  # not 10000: the fallback of a lost mapping (import or export)
    tie_word_embeddings=False,
)
KINDS = {
    "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig, {}),
    "mixtral": (
        transformers.MixtralForCausalLM,
        transformers.MixtralConfig,
        dict(num_local_experts=4, num_experts_per_tok=2),
    ),
}


@pytest.fixture(scope="module", params=list(KINDS))
def exported(request, tmp_path_factory):
    """A random tiny HF model -> import-hf (our checkpoint) -> export-hf; (checkpoint, export)."""
    root = tmp_path_factory.mktemp(request.param)
    cls, config, extra = KINDS[request.param]
    torch.manual_seed(0)
    hf = cls(config(**BASE, **extra)).float().eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # logits far apart: no near-ties for argmax
    hf.save_pretrained(root / "hf")
    assert main(["import-hf", str(root / "hf"), str(root / "ck")]) == 0
    assert main(["export-hf", str(root / "ck"), str(root / "export")]) == 0
    return root / "ck", root / "export"


def test_cached_logits_equal_the_full_forward(exported):
    model = load_model(exported[0])
    ids = torch.randint(0, 264, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids)
        cache = KVCache()
        parts = [model(ids[:, :7], cache), model(ids[:, 7:12], cache)]  # a prefill, then a chunk
        parts += [model(ids[:, i : i + 1], cache) for i in range(12, 20)]  # then one at a time
    assert cache.length == 20
    assert (torch.cat(parts, dim=1) - full).abs().max().item() <= 1e-5


def test_greedy_equals_transformers_on_the_export(exported):
    ckpt, export = exported
    hf = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    for prompt in ([5, 17, 200, 3], [100]):
        ours = list(generate_ids(load_model(ckpt), prompt, 40, temperature=0.0))
        with torch.no_grad():
            theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False, eos_token_id=None)
        assert ours == theirs[0, len(prompt) :].tolist()


def test_sampling_is_seeded_and_respects_top_k_and_top_p():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    gen = torch.Generator().manual_seed(3)
    assert {pick(logits, 1.0, 2, 1.0, gen) for _ in range(200)} == {0, 1}
    assert {pick(logits, 1.0, 0, 0.5, gen) for _ in range(200)} == {0}  # p(0) = 0.64 >= 0.5
    assert len({pick(logits, 5.0, 0, 1.0, gen) for _ in range(400)}) == 5
    a = [pick(logits, 1.0, 0, 1.0, torch.Generator().manual_seed(9)) for _ in range(20)]
    b = [pick(logits, 1.0, 0, 1.0, torch.Generator().manual_seed(9)) for _ in range(20)]
    assert a == b and pick(logits, 0.0, 0, 1.0, gen) == 0


def test_generate_command_streams_text(exported, tmp_path):
    ckpt, _ = exported
    byte_tokenizer().save(str(tmp_path / "tokenizer.json"))
    args = [str(ckpt), "--prompt", "def f", "--max-new-tokens", "12", "--temperature", "0"]
    cmd = [sys.executable, "-m", "dtensor3d", "generate", *args, "--tokenizer", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("def f") and "tokens/s" in proc.stderr
    ours = list(generate_ids(load_model(ckpt), list(b"def f"), 12))
    expect = byte_tokenizer().decode(ours, skip_special_tokens=True)
    assert proc.stdout == "def f" + expect + "\n"
    bad = subprocess.run([*cmd[:-2]], cwd=ROOT, capture_output=True, text=True, timeout=300)  # no tokenizer anywhere
    assert bad.returncode == 2 and bad.stderr.startswith("error:") and "--tokenizer" in bad.stderr


def test_bad_arguments_one_line_before_the_model_loads(exported, tmp_path, capsys, monkeypatch):
    """A missing checkpoint, bad numbers, and a tokenizer larger than the model's vocabulary are
    each one `error:` line (exit 2), found before any weight is read."""
    from tokenizers import Tokenizer, models

    import dtensor3d.checkpoint.hf as hf

    ckpt, _ = exported
    big = Tokenizer(models.WordLevel({f"w{i}": i for i in range(300)}, unk_token="w0"))  # 300 > vocab 264
    big.save(str(tmp_path / "tokenizer.json"))
    byte_tokenizer().save(str(tmp_path / "byte.json"))

    def no_weights(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(hf, "model_from", no_weights)
    cases = [
        (["generate", str(tmp_path / "nope"), "--prompt", "x"], "no such checkpoint"),
        (["export-hf", str(tmp_path / "nope"), str(tmp_path / "out")], "no such checkpoint"),
        (["generate", str(ckpt), "--prompt", "x", "--top-p", "0", "--tokenizer", str(tmp_path / "byte.json")], "top-p"),
        (
            ["generate", str(ckpt), "--prompt", "w1", "--tokenizer", str(tmp_path)],
            "more than the model's vocab_size=264",
        ),
        (
            ["generate", str(ckpt), "--prompt", "x", "--chat", "--tokenizer", str(tmp_path / "byte.json")],
            "generate --chat: tokenizer '" + str(tmp_path / "byte.json") + "' has no chat template",
        ),
    ]
    for argv, needle in cases:
        capsys.readouterr()
        assert main(argv) == 2, argv
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], (argv, lines)
    assert not (tmp_path / "out").exists()


def test_generate_chat_wraps_the_prompt_in_the_template(exported, tmp_path, capsys):
    """--chat: the prompt's ids are transformers' apply_chat_template(add_generation_prompt=True)
    of one user turn; only the reply is printed, up to the first end-of-turn token."""
    from helpers import CHATML

    ckpt, _ = exported
    if ckpt.parent.name.startswith("mixtral"):
        pytest.skip("the prompt's wrapping does not depend on the family: checked once, on llama")
    tok = byte_tokenizer()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])  # 259 tokens, within vocab 264
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "chat_template.jinja").write_text(CHATML)  # as transformers saves it
    (tmp_path / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')
    messages = [{"role": "user", "content": "def f"}]
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    prompt = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert prompt_ids(tok, str(tmp_path / "tokenizer.json"), "def f", chat=True) == (prompt["input_ids"], "<|im_end|>")
    assert visible("ab<|im", "<|im_end|>") == ("ab", False) and visible("a<|im_end|>\nb", "<|im_end|>") == ("a", True)
    assert stop_ids(tok, chat=True) == (stops := {tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")})
    ours = list(generate_ids(load_model(ckpt), prompt["input_ids"], 16, eos=stops))
    args = ["generate", str(ckpt), "--prompt", "def f", "--chat", "--tokenizer", str(tmp_path)]
    assert main([*args, "--max-new-tokens", "16", "--temperature", "0"]) == 0
    assert capsys.readouterr().out == tok.decode(ours, skip_special_tokens=True) + "\n"
    assert len(ours) == 16 or ours[-1] in stops


def test_generate_on_an_empty_directory_says_there_is_no_checkpoint(tmp_path):
    """Issue 43 item 13: an empty directory is "no checkpoint there", not "no tokenizer.json"."""
    (tmp_path / "empty").mkdir()
    cmd = [sys.executable, "-m", "dtensor3d", "generate", str(tmp_path / "empty"), "--prompt", "x"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:"), proc.stderr
    assert "holds no complete checkpoint" in lines[0] and "tokenizer" not in lines[0], lines[0]


class Writes(list):
    def write(self, text: str) -> None:
        self.append(text)

    def flush(self) -> None:
        pass


def test_streaming_prints_a_character_split_across_tokens_whole():
    """Issue 43 item 14: with a byte-level tokenizer each byte of é, €, 😀 is its own token;
    every piece generate streams holds whole characters (no U+FFFD), and with --chat's
    end-of-turn text spelled in plain tokens the reply stops before it."""
    tok = byte_tokenizer()
    text = "aé€😀b — ünïcödé"
    writes = Writes()
    stream = TextStream(tok, "", writes)
    assert not any(stream.step(b) for b in text.encode())
    assert "".join(writes) == text and not any("\ufffd" in w for w in writes), writes
    assert "é" in writes and "€" in writes and "😀" in writes  # each printed once its last byte came
    writes = Writes()
    stream = TextStream(tok, "<|im_end|>", writes)
    over = [stream.step(b) for b in "ok 😀<|im_end|>\nmore".encode()]
    assert "".join(writes) == "ok 😀" and over.index(True) == len("ok 😀<|im_end|>".encode()) - 1
    assert not any("\ufffd" in w for w in writes)


def _cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "dtensor3d", *map(str, args)]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_export_and_import_overwrite_only_their_own_directories(exported, tmp_path):
    """Issue 43 item 15: OUT holding one empty file is "not empty" and the line names the file;
    --overwrite replaces a directory the same command wrote (export-hf's by export-hf,
    import-hf's by import-hf) and nothing else."""
    ckpt, export = exported
    if ckpt.parent.name.startswith("mixtral"):
        pytest.skip("OUT's handling does not depend on the family: checked once, on llama")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("")
    for extra, needle in (([], "exists and is not empty (it holds notes.txt)"), (["--overwrite"], "not a directory")):
        proc = _cli("export-hf", ckpt, tmp_path / "mine", *extra)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and needle in lines[0] and "notes.txt" in lines[0], lines
    assert os.listdir(tmp_path / "mine") == ["notes.txt"]
    again = tmp_path / "again"
    assert main(["export-hf", str(ckpt), str(again)]) == 0
    (again / "model.safetensors").write_bytes(b"stale")
    proc = _cli("export-hf", ckpt, again, "--overwrite")
    assert proc.returncode == 0, proc.stderr
    assert (again / "model.safetensors").read_bytes() == (export / "model.safetensors").read_bytes()
    proc = _cli("import-hf", export, again, "--overwrite")  # export-hf's directory: not import-hf's
    assert proc.returncode == 2 and "not a directory import-hf wrote" in proc.stderr, proc.stderr
    imported = tmp_path / "ck"
    assert main(["import-hf", str(export), str(imported)]) == 0
    (imported / "step_00000000" / "extra").write_text("x")
    proc = _cli("import-hf", export, imported, "--overwrite")
    assert proc.returncode == 0 and "step_00000000" in proc.stdout, proc.stderr
    assert not (imported / "step_00000000" / "extra").exists() and not list(tmp_path.glob("ck.*"))
