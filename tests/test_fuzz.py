"""Hypothesis fuzzing of the metadata and state constructors and of `fspec.generate` on a tiny model.

Reproducible: every test is `derandomize=True` (the examples are a function of the test), `deadline=None`.
Example counts are in RELIABILITY.md (`pytest --hypothesis-show-statistics tests/test_fuzz.py` prints them).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import fspec

from draft_setup import tiny_draft
from engine_setup import aligned_pair

FUZZ = settings(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


# --- metadata and state constructors ------------------------------------------------------------------------


@st.composite
def paged_batches(draw):
    """B requests over a shared pool of blocks: request b owns a prefix of `alloc[b]` distinct blocks (the
    rest of its row is -1, unallocated); some blocks of the pool belong to nobody."""
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    b = draw(st.integers(1, 6))
    max_blocks = draw(st.integers(1, 5))
    alloc = draw(st.lists(st.integers(0, max_blocks), min_size=b, max_size=b))
    num_blocks = sum(alloc) + draw(st.integers(1, 4))
    pool = draw(st.permutations(list(range(num_blocks))))
    table = torch.full((b, max_blocks), -1, dtype=torch.int32)
    used = 0
    for r, n in enumerate(alloc):
        table[r, :n] = torch.tensor(pool[used : used + n], dtype=torch.int32)
        used += n
    max_model_len = max_blocks * block_size + draw(st.integers(0, 3))
    return table, alloc, block_size, num_blocks, max_model_len


def _live_positions(draw, alloc: list[int], block_size: int) -> torch.Tensor:
    """One position per request inside its allocated blocks, or -1 (padding; always when it owns none)."""
    out = []
    for n in alloc:
        padding = n == 0 or draw(st.integers(0, 3)) == 0
        out.append(-1 if padding else draw(st.integers(0, n * block_size - 1)))
    return torch.tensor(out, dtype=torch.int64)


@settings(FUZZ, max_examples=500)
@given(paged_batches(), st.data())
def test_decode_metadata_validates_gives_distinct_slots_and_advances_like_a_fresh_build(batch, data):
    """decode_metadata of in-allocation positions passes validate_attn_metadata; live slots are distinct,
    inside the pool and equal to block * block_size + offset, padding slots -1; advance equals a fresh build
    at positions + 1 (clamped at max_model_len - 1) and validates exactly when every live request stays on
    its allocated blocks."""
    table, alloc, bs, num_blocks, mml = batch
    pos = _live_positions(data.draw, alloc, bs)
    meta = fspec.decode_metadata(pos, table, block_size=bs)
    fspec.validate_attn_metadata(meta, block_size=bs, max_model_len=mml, num_blocks=num_blocks)
    live = pos >= 0
    slots = meta.slot_mapping
    assert bool((slots[~live] == -1).all()), "a padding row got a slot"
    assert slots[live].unique().numel() == int(live.sum()), "two live tokens share a slot"
    for b in range(len(alloc)):
        if live[b]:
            p = int(pos[b])
            assert int(slots[b]) == int(table[b, p // bs]) * bs + p % bs
            assert 0 <= int(slots[b]) < num_blocks * bs
    nxt = fspec.advance(meta, block_size=bs, max_model_len=mml)
    new_pos = torch.where(live, (pos + 1).clamp(max=mml - 1), pos)
    fresh = fspec.decode_metadata(new_pos, table, block_size=bs)
    for got, want in zip(fspec.tree.tree_leaves(nxt), fspec.tree.tree_leaves(fresh)):
        assert got.dtype == want.dtype and torch.equal(got, want)
    fits = all(not live[b] or int(new_pos[b]) < alloc[b] * bs for b in range(len(alloc)))
    try:
        fspec.validate_attn_metadata(nxt, block_size=bs, max_model_len=mml, num_blocks=num_blocks)
        accepted = True
    except ValueError:
        accepted = False
    assert accepted == fits, f"validate accepted={accepted} but staying on allocated blocks={fits}"


@settings(FUZZ, max_examples=400)
@given(paged_batches(), st.integers(1, 5), st.data())
def test_first_step_metadata_validates_and_decode_after_continues_each_request(batch, num_query, data):
    """A first step of up to Q tokens per request inside its allocation validates (as metadata and as a draft
    state built by init_draft_state with random temperatures and seeds); decode_after puts each request's
    next token at seq_lens (clamped), padding stays padding, and the draft state keeps its declared leaves."""
    table, alloc, bs, num_blocks, mml = batch
    starts, counts = [], []
    for n in alloc:
        room = n * bs
        if room == 0 or data.draw(st.integers(0, 4)) == 0:
            starts.append(-1)
            counts.append(data.draw(st.integers(0, num_query)))  # ignored for padding rows
            continue
        start = data.draw(st.integers(0, room - 1))
        starts.append(start)
        counts.append(data.draw(st.integers(0, min(num_query, room - start))))
    start_t, count_t = torch.tensor(starts), torch.tensor(counts)
    meta = fspec.first_step_metadata(start_t, count_t, table, num_query=num_query, block_size=bs)
    fspec.validate_attn_metadata(meta, block_size=bs, max_model_len=mml, num_blocks=num_blocks)
    want_lens = [s + c if s >= 0 else 0 for s, c in zip(starts, counts)]
    assert meta.seq_lens.tolist() == want_lens
    nxt = fspec.decode_after(meta, block_size=bs, max_model_len=mml)
    assert nxt.positions.tolist() == [min(n, mml - 1) if n > 0 else -1 for n in want_lens]
    assert nxt.slot_mapping[nxt.positions < 0].eq(-1).all()
    # the same metadata as a draft state
    model = fspec.ModelConfig(
        vocab_size=11, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=4,
    )  # fmt: skip
    k = data.draw(st.integers(1, 4))
    cfg = fspec.DraftConfig(
        kind="eagle", model=model, num_speculative_steps=k, block_size=bs, max_model_len=mml,
        greedy_drafts=data.draw(st.booleans()),
    )  # fmt: skip
    b, t = len(alloc), meta.num_tokens
    temps = data.draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0]), min_size=b, max_size=b))
    seeds = data.draw(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=b, max_size=b))
    ids = torch.tensor(data.draw(st.lists(st.integers(0, 10), min_size=t, max_size=t)), dtype=torch.int64)
    state = fspec.init_draft_state(ids, torch.zeros(t, 8), meta, cfg=cfg, temperature=temps, seed=seeds)
    fspec.validate_draft_state(state, cfg=cfg, num_blocks=num_blocks)
    assert state.sampling.seed.tolist() == seeds and state.sampling.temperature.tolist() == temps
    vd = 0 if cfg.greedy_drafts else 11
    assert state.draft_tokens.shape == (b, k) and state.draft_probs.shape == (b, k, vd)
    assert int(state.step) == 0 and bool((state.draft_tokens == -1).all())


# --- generate: greedy speculation equals target-only greedy decoding ----------------------------------------


@functools.cache
def _pair():
    target, draft = aligned_pair(k=3)
    return target, {"eagle": draft, "eagle3": tiny_draft(target, kind="eagle3", k=3),
                    "mtp": tiny_draft(target, kind="mtp", k=3)}  # fmt: skip


@settings(FUZZ, max_examples=300)
@given(
    prompts=st.lists(
        st.one_of(st.integers(1, 47), st.integers(38, 47)).flatmap(  # half of them near max_model_len
            lambda n: st.lists(st.integers(0, 96), min_size=n, max_size=n)
        ),
        min_size=1,
        max_size=6,
    ),
    k=st.integers(1, 7),
    max_new_tokens=st.integers(1, 24),
    kind=st.sampled_from(["eagle", "eagle", "eagle3", "mtp"]),
    eos=st.lists(st.integers(0, 96), max_size=3, unique=True),
)
@example(prompts=[[0]], k=3, max_new_tokens=15, kind="eagle", eos=[])  # ran out of cache blocks once
def test_greedy_speculation_always_equals_target_only_greedy_decoding(prompts, k, max_new_tokens, kind, eos):
    """Random prompts (1..47 tokens of max_model_len 48, any ids), K, max_new_tokens, batch size 1..6, head
    kind (the aligned EAGLE head or random EAGLE-3 / MTP heads) and EOS set: speculative greedy output equals
    target-only greedy output token for token, including where requests hit EOS or max_model_len."""
    target, heads = _pair()
    target = dataclasses.replace(target, cfg=dataclasses.replace(target.cfg, eos_token_ids=tuple(eos)))
    want = fspec.generate(target, None, prompts, max_new_tokens=max_new_tokens)
    got = fspec.generate(target, heads[kind], prompts, max_new_tokens=max_new_tokens, num_speculative_steps=k)
    assert got.tokens == want.tokens
    for p, toks in zip(prompts, got.tokens):
        assert 1 <= len(toks) <= max_new_tokens and len(p) + len(toks) <= 48
        assert all(t not in eos for t in toks[:-1]), "a request ran past an EOS token"


# slow: the same claim, for fixed requests, is tests/test_reliability.py's
# test_same_seeds_give_the_same_tokens_across_runs_and_batch_compositions (speculative and target-only)
@pytest.mark.slow
@pytest.mark.parametrize("speculative", [True, False])
@settings(FUZZ, max_examples=40)
@given(
    prompts=st.lists(st.lists(st.integers(0, 96), min_size=1, max_size=40), min_size=2, max_size=5),
    temps=st.lists(st.sampled_from([0.0, 0.3, 1.0, 1.7]), min_size=5, max_size=5),
    seeds=st.lists(st.integers(-(2**63), 2**63 - 1), min_size=5, max_size=5),
)
def test_sampled_tokens_depend_only_on_prompt_temperature_and_seed(speculative, prompts, temps, seeds):
    """Sampled (and greedy) requests give the same tokens alone as in a batch, for random seeds."""
    target, heads = _pair()
    head = heads["eagle"] if speculative else None
    n = len(prompts)
    batch = fspec.generate(target, head, prompts, max_new_tokens=8, temperature=temps[:n], seed=seeds[:n])
    i = n - 1
    alone = fspec.generate(target, head, [prompts[i]], max_new_tokens=8, temperature=temps[i], seed=seeds[i])
    assert alone.tokens[0] == batch.tokens[i]


# --- checkpoint directories: one mutated config.json field or one truncated file ----------------------------

JSON_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([-1, 0, 1, 2, 3, 97]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.lists(st.one_of(st.none(), st.integers(-3, 100), st.text(max_size=2)), max_size=3),
    st.dictionaries(st.sampled_from(["rope_type", "factor", "kind", "type"]), st.integers(-2, 3), max_size=2),
)
EXTRA_FIELDS = ["hidden_act", "mlp_bias", "rope_parameters", "rope_scaling", "head_dim", "eos_token_id"]


@functools.cache
def _checkpoint_dirs() -> dict:
    """A toy target (with tokenizer.json) and an EAGLE-3 head, written once for the whole module."""
    import tempfile

    from tokenizers import Tokenizer, models

    from draft_setup import tiny_target

    root = tempfile.mkdtemp(prefix="fspec-fuzz-")
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(97)}, unk_token="w0"))
    target = dataclasses.replace(tiny_target(), tokenizer=tok)
    fspec.save_target(target, f"{root}/target")
    fspec.save_draft(tiny_draft(target, kind="eagle3", k=2), f"{root}/eagle3")
    return {"root": root, "target": target}


@st.composite
def checkpoint_mutations(draw, which: str):
    """("field", dotted key, JSON value) or ("truncate", file name, fraction kept)."""
    import json
    from pathlib import Path

    path = Path(_checkpoint_dirs()["root"]) / which
    config = json.loads((path / "config.json").read_text())
    if draw(st.booleans()):
        keys = sorted(config) + EXTRA_FIELDS
        if which != "target":
            keys += [f"fspec_draft.{k}" for k in sorted(config["fspec_draft"])]
        return ("field", draw(st.sampled_from(keys)), draw(JSON_VALUES))
    files = ["config.json", "model.safetensors"] + (["tokenizer.json"] if which == "target" else [])
    return ("truncate", draw(st.sampled_from(files)), draw(st.floats(0, 1, exclude_max=True)))


def _mutated_load(which: str, mutation) -> None:
    """Copy the saved checkpoint, apply `mutation`, load it: success, ValueError or FileNotFoundError only,
    within a few seconds."""
    import json
    import shutil
    import tempfile
    import time
    from pathlib import Path

    dirs = _checkpoint_dirs()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / which
        shutil.copytree(Path(dirs["root"]) / which, path)
        kind, name, value = mutation
        if kind == "field":
            config = json.loads((path / "config.json").read_text())
            *parents, leaf = name.split(".")
            node = config
            for p in parents:
                node = node[p]
            node[leaf] = value
            (path / "config.json").write_text(json.dumps(config))
        else:
            data = (path / name).read_bytes()
            (path / name).write_bytes(data[: int(len(data) * value)])
        began = time.perf_counter()
        try:
            if which == "target":
                fspec.load_target(path)
            else:
                fspec.load_draft(path, target=dirs["target"])
        except (ValueError, FileNotFoundError):
            pass
        assert time.perf_counter() - began < 5.0, f"{mutation} took {time.perf_counter() - began:.1f} s"


@settings(FUZZ, max_examples=60)
@given(checkpoint_mutations("target"))
@example(("field", "num_attention_heads", 0))
@example(("field", "eos_token_id", [1, None]))
@example(("truncate", "model.safetensors", 0.5))
def test_load_target_of_a_mutated_checkpoint_loads_or_names_the_problem(mutation):
    """One config.json field set to any JSON value, or one file cut anywhere: load_target succeeds or raises
    ValueError / FileNotFoundError (never TypeError, KeyError, a library error or a hang)."""
    _mutated_load("target", mutation)


@settings(FUZZ, max_examples=60)
@given(checkpoint_mutations("eagle3"))
@example(("field", "fspec_draft", [1]))
@example(("field", "fspec_draft.target_layer_ids", "abc"))
def test_load_draft_of_a_mutated_checkpoint_loads_or_names_the_problem(mutation):
    """The same for an EAGLE-3 head's directory (its fspec_draft record included)."""
    _mutated_load("eagle3", mutation)
