"""The embedded default model's pipeline at toy sizes: tokenizer, target, head, files that load back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import fspec
from fspec.train import toy_model

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def test_tiny_pipeline_writes_a_target_and_head_that_load_and_generate(tmp_path: Path):
    """`--tiny` trains tokenizer, target and EAGLE-3 head; the bf16 files load back, generate losslessly."""
    assert toy_model.main(["--out", str(tmp_path), "--tiny", "--device", "cpu"]) == 0
    log = json.loads((tmp_path / "train_log.json").read_text())
    r = toy_model.TINY
    # The target learned something: below the uniform loss ln(V) on held-out files.
    records = log["target"]["records"]
    assert log["target"]["steps"] == r.target_steps and records[-1]["step"] == r.target_steps
    assert log["target"]["held_out_loss"] < 0.9 * torch.log(torch.tensor(float(r.vocab_size))).item()
    assert records[-1]["loss"] < records[0]["loss"] and records[-1]["tokens_per_s"] > 0
    # Its own continuations of training prompts joined the head's data (prompt + new tokens + EOS per row).
    g = log["generated"]
    assert g["sequences"] == r.generated_sequences and 0 < g["new_tokens"] <= 8 * r.generated_new_tokens
    assert g["stream_tokens"] >= g["new_tokens"] + 8 * r.generated_prompt_len
    # The head trained K = 7 steps with the 256 most frequent tokens as its vocabulary.
    draft_log = log["draft"]["records"]
    assert len(draft_log[-1]["agreement"]) == r.ttt_steps and draft_log[-1]["step"] == r.draft_steps
    assert draft_log[-1]["loss"] < draft_log[0]["loss"]
    # What ships: bf16 weights in HF / EAGLE-3 layouts, with the tokenizer.
    target, draft = toy_model.load_toy(tmp_path)
    assert target.params["embed"].dtype == torch.bfloat16 and target.tokenizer is not None
    assert target.cfg.hidden_size == r.hidden_size and target.cfg.tie_word_embeddings
    assert draft.cfg.kind == "eagle3" and draft.cfg.draft_vocab_size == r.draft_vocab_size
    assert draft.params["fc"].dtype == torch.bfloat16 and draft.params["d2t"].dtype == torch.int64
    assert int(draft.params["t2d"].sum()) == r.draft_vocab_size
    config = json.loads((tmp_path / "eagle3" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert log["bytes"]["target"] < 1_000_000 and log["bytes"]["eagle3"] < 1_000_000
    # Acceptance was measured on held-out prompts with the saved files, and generation runs from them.
    acc = log["acceptance"]
    assert 1.0 <= acc["acceptance_length"] <= r.eval_k + 1 and acc["num_speculative_steps"] == r.eval_k
    assert acc["greedy_tokens_equal_to_target_only"] == 1.0  # greedy speculative decoding is lossless
    out = fspec.generate(target, draft, ["def main("], max_new_tokens=8, num_speculative_steps=3)
    plain = fspec.generate(target, None, ["def main("], max_new_tokens=8)
    assert out.tokens == plain.tokens and out.stats["acceptance_length"] >= 1.0


def test_load_toy_names_the_missing_directory(tmp_path: Path):
    """Without built assets, load_toy raises FileNotFoundError saying how to build them."""
    with pytest.raises(FileNotFoundError, match="python -m fspec.train.toy_model"):
        toy_model.load_toy(tmp_path / "absent")


def test_command_line_recipe_is_the_shipped_one_and_time_budgets_replace_step_counts():
    """No options: FULL (2000 target steps: the early stop the shipped target was built with). A time budget
    asked for replaces that part's fixed step count; an explicit step count still wins; bad ids name the
    option."""
    from fspec.train.toy_model import FULL, _parser, recipe_from_args

    def recipe(*argv):
        p = _parser()
        return recipe_from_args(p.parse_args(list(argv)), p)

    assert recipe() == FULL and FULL.target_steps == 2000 and FULL.target_layer_ids == (1, 2, 3)
    assert FULL.draft_steps == 3000 and FULL.generated_sequences == 16384
    assert recipe("--generated-sequences", "0").generated_sequences == 0
    with pytest.raises(SystemExit):
        recipe("--generated-sequences", "-3")
    r = recipe("--minutes", "7")
    assert (r.target_steps, r.draft_steps, r.target_minutes, r.draft_minutes) == (0, 0, 4.0, 3.0)
    r = recipe("--target-minutes", "2", "--target-steps", "50")
    assert (r.target_steps, r.target_minutes, r.draft_minutes) == (50, 2.0, FULL.draft_minutes)
    assert recipe("--target-layer-ids", "1,2,4").target_layer_ids == (1, 2, 4)
    with pytest.raises(SystemExit):
        recipe("--target-layer-ids", "1,x,4")


def test_generated_rows_are_training_windows_continued_by_the_target_itself():
    """Self-distillation data: each prompt is a window of the training stream; row i's continuation is exactly
    what target-only generation gives that prompt (greedy for even i, T = 1 with seed * 1_000_003 + i for odd
    i); the stream is prompt + continuation + EOS per row; a target without EOS is refused."""
    import dataclasses

    from draft_setup import tiny_target

    base = tiny_target()
    target = dataclasses.replace(base, cfg=dataclasses.replace(base.cfg, eos_token_ids=(5,)))
    tokens = torch.randint(0, 97, (400,), generator=torch.Generator().manual_seed(3), dtype=torch.int32)
    r = dataclasses.replace(
        toy_model.TINY, generated_sequences=5, generated_prompt_len=6, generated_new_tokens=9
    )
    prompts, conts, _ = toy_model.generated_rows(r, target, tokens, seed=2)
    windows = tokens.unfold(0, 6, 1).tolist()
    assert len(prompts) == len(conts) == 5 and all(p in windows for p in prompts)
    for i, (p, c) in enumerate(zip(prompts, conts)):
        kw = {"temperature": float(i % 2), "seed": 2 * 1_000_003 + i}
        assert c == fspec.generate(target, None, [p], max_new_tokens=9, **kw).tokens[0]
    assert any(
        c != fspec.generate(target, None, [p], max_new_tokens=9).tokens[0] for p, c in zip(prompts, conts)
    )
    stream, log = toy_model.generated_stream(r, target, tokens, seed=2)
    rows = [p + c + [5] for p, c in zip(prompts, conts)]
    assert stream.tolist() == [t for row in rows for t in row] and stream.dtype == torch.int32
    assert log["sequences"] == 5 and log["new_tokens"] == sum(map(len, conts))
    with pytest.raises(ValueError, match="target: expected a config with an EOS id"):
        toy_model.generated_stream(r, base, tokens, seed=2)
    for field, bad in (
        ("generated_sequences", 0),
        ("generated_prompt_len", -1),
        ("generated_new_tokens", 1.5),
    ):
        with pytest.raises(ValueError, match=f"{field}: expected a positive int, got {bad!r}"):
            toy_model.generated_rows(dataclasses.replace(r, **{field: bad}), target, tokens, seed=2)
