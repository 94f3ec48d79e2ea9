"""The command line runs and prints what it claims."""

from __future__ import annotations

import dataclasses
import inspect
import json
import types

import pytest
import torch

import fspec
import fspec.train.prompts
from fspec.cli import main

from engine_setup import aligned_pair


def test_demo_answers_a_held_out_chat_prompt_with_the_real_model_losslessly(capsys):
    """`fspec demo`: SmolLM2-135M-Instruct and its shipped EAGLE-3 head answer a held-out chat prompt through
    the chat template; greedy speculative tokens equal target-only greedy tokens, the head gets more than one
    token per target forward, and the last line is JSON with the acceptance length and both speeds."""
    assert main(["demo", "--max-new-tokens", "24"]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["demo"] == "smollm2-135m-instruct" and len(record["tokens"]) <= 24
    assert record["prompt"] == fspec.train.prompts.heldout("chat")[0] and record["threads"] == 1
    assert record["same_tokens"] is True
    assert record["acceptance_length"] > 1.1  # an untrained head gets about 1.0
    ratio = record["tokens_per_second"] / record["target_only_tokens_per_second"]
    assert abs(record["speedup"] - ratio) < 1e-9
    target, _ = fspec.load_default()
    chat = fspec.render_chat(target, [{"role": "user", "content": record["prompt"]}])
    ids = target.tokenizer.encode(chat, add_special_tokens=False).ids
    assert fspec.generate(target, None, [ids], max_new_tokens=24).tokens[0] == record["tokens"]


def test_generate_command_runs_a_saved_target_and_head(tmp_path, capsys):
    """`fspec generate` on HF directories written by save_target/save_draft: greedy speculative tokens
    equal target-only tokens; --json carries the acceptance length and tokens/s."""
    target, draft = aligned_pair(k=3)
    fspec.save_target(target, tmp_path / "t")
    fspec.save_draft(draft, tmp_path / "d")
    base = [
        "generate",
        "--target",
        str(tmp_path / "t"),
        "--tokens",
        "1 2 3",
        "--max-new-tokens",
        "12",
        "--json",
    ]
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(base + ["--draft", str(tmp_path / "d"), "-k", "3"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["tokens"] == plain["tokens"] and len(spec["tokens"]) == 12 and spec["index"] == 0
    assert spec["acceptance_length"] > 1.2 and plain["acceptance_length"] == 1.0
    assert spec["text"] is None and spec["tokens_per_second"] > 0
    assert main(base[:-1]) == 0  # no tokenizer, no --json: the ids, space-separated
    assert capsys.readouterr().out.split() == [str(t) for t in plain["tokens"]]


# --- chat prompts, JSONL files, options, errors ------------------------------------------------------------

TEMPLATE = (
    "{% for m in messages %}<|pad|>{{ m['role'] }}\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|pad|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def toy_dirs(tmp_path_factory):
    """The toy target (with a chat template) and its EAGLE-3 head saved as directories, and both loaded."""
    root = tmp_path_factory.mktemp("toy")
    target, draft = fspec.load_toy()
    target = dataclasses.replace(target, chat_template=TEMPLATE)
    fspec.save_target(target, root / "t")
    (root / "t" / "chat_template.jinja").write_text(TEMPLATE)
    fspec.save_draft(draft, root / "d")
    return str(root / "t"), str(root / "d"), target, draft


def json_lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.strip().splitlines()]


def test_generate_chat_prompts_and_jsonl_requests_match_the_api(toy_dirs, tmp_path, capsys):
    """--chat --prompt, a JSONL file of messages and plain prompts (one with its own temperature and seed):
    one JSON line per request, each equal to fspec.generate on the same ids and settings (the head's K)."""
    t, d, target, draft = toy_dirs
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def add(a, b):"}]
    lines = [{"messages": chat}, {"prompt": "import os", "temperature": 0.9, "seed": 7}]
    file = tmp_path / "p.jsonl"
    file.write_text(json.dumps(lines[0]) + "\n\n" + json.dumps(lines[1]) + "\n")
    argv = ["generate", "--target", t, "--draft", d, "--max-new-tokens", "8", "--json", "--seed", "3"]
    assert main(argv + ["--prompt", "class A:", "--chat", "--prompts-file", str(file)]) == 0
    records = json_lines(capsys.readouterr().out)
    ids = [
        target.tokenizer.apply_chat_template([{"role": "user", "content": "class A:"}]),
        target.tokenizer.apply_chat_template(chat),
        target.tokenizer.apply_chat_template([{"role": "user", "content": "import os"}]),  # --chat wraps it
    ]
    ref = fspec.generate(
        target,
        draft,
        ids,
        max_new_tokens=8,
        temperature=[0.0, 0.0, 0.9],
        seed=[3, 3, 7],
        num_speculative_steps=draft.cfg.num_speculative_steps,
    )
    assert [r["index"] for r in records] == [0, 1, 2]
    assert [r["tokens"] for r in records] == ref.tokens and [r["text"] for r in records] == ref.text
    assert all(r["acceptance_length"] >= 1.0 and r["tokens_per_second"] > 0 for r in records)


def test_generate_prints_text_and_honours_dtype_device_threads(toy_dirs, capsys):
    """Without --json: each request's text (headed by its index when there are several); --dtype float32,
    --device cpu and --threads give fspec.generate's tokens for the float32 target."""
    t, _, target, _ = toy_dirs
    threads = str(torch.get_num_threads())  # the test process keeps its thread count
    argv = ["generate", "--target", t, "--max-new-tokens", "6", "--no-stream", "--dtype", "float32"]
    assert (
        main(argv + ["--device", "cpu", "--threads", threads, "--prompt", "import os", "--prompt", "x = 1"])
        == 0
    )
    out = capsys.readouterr()
    f32 = fspec.load_target(t, dtype=torch.float32)
    ref = fspec.generate(f32, None, ["import os", "x = 1"], max_new_tokens=6)
    assert out.out == f"--- prompt 0 ---\n{ref.text[0]}\n--- prompt 1 ---\n{ref.text[1]}\n"
    assert "2 request(s), 12 new tokens" in out.err


def test_generate_kwargs_maps_every_option():
    """Each option reaches its fspec.generate keyword, and the optional ones only when given."""
    from fspec.cli import _parser, generate_kwargs

    def kwargs(*extra):
        return generate_kwargs(_parser().parse_args(["generate", "--target", "T", *extra]))

    base = dict(max_new_tokens=64, temperature=0.0, seed=0, compile=False, progress=False)
    assert kwargs() == base
    full = kwargs(
        *("--max-new-tokens", "300", "--temperature", "0.7", "--seed", "5", "--compile", "-k", "4"),
        *("--top-k", "20", "--top-p", "0.9", "--min-p", "0.05", "--stop", "\n\n", "--stop", "END"),
        *("--stop-token-id", "7", "--stop-token-id", "9", "--ignore-eos", "--min-new-tokens", "3"),
        *("--eos-token-id", "2"),
    )
    assert full == dict(
        max_new_tokens=300,
        temperature=0.7,
        seed=5,
        compile=True,
        progress=True,
        num_speculative_steps=4,
        top_k=20,
        top_p=0.9,
        min_p=0.05,
        stop=["\n\n", "END"],
        stop_token_ids=[7, 9],
        ignore_eos=True,
        min_new_tokens=3,
        eos_token_id=2,
    )
    assert kwargs("--num-speculative-steps", "2", "--max-new-tokens", "300", "--json") == dict(
        base, max_new_tokens=300, num_speculative_steps=2
    )  # no progress bar in JSON mode


def test_every_bad_input_is_one_error_line_and_exit_code_2(toy_dirs, tmp_path, capsys):
    """Missing paths, bad numbers and choices, values generate refuses, options it does not take, malformed
    JSONL lines and chats: exit code 2 and exactly one line `fspec: error: ...` naming the culprit."""
    t, d, _, _ = toy_dirs
    bad = tmp_path / "bad.jsonl"
    cases = {
        "--target: path: expected a checkpoint directory": [
            "--target",
            str(tmp_path / "none"),
            "--prompt",
            "x",
        ],
        "--draft: path: expected a checkpoint directory": ["--target", t, "--draft", "nope", "--prompt", "x"],
        "argument --max-new-tokens: invalid int value: 'many'": [
            "--target",
            t,
            "--prompt",
            "x",
            "--max-new-tokens",
            "many",
        ],
        "argument --dtype: invalid choice: 'int8'": ["--target", t, "--prompt", "x", "--dtype", "int8"],
        "max_new_tokens: expected a positive int, got 0": [
            "--target",
            t,
            "--prompt",
            "x",
            "--max-new-tokens",
            "0",
        ],
        "temperature[0]: expected a finite value >= 0, got -1.0": [
            "--target",
            t,
            "--prompt",
            "x",
            "--temperature",
            "-1",
        ],
        "num_speculative_steps: expected an int in [1, 16], got 40": [
            "--target",
            t,
            "--draft",
            d,
            "--prompt",
            "x",
            "-k",
            "40",
        ],
        "--tokens: expected token ids separated by spaces or commas, got '1 two'": [
            "--target",
            t,
            "--tokens",
            "1 two",
        ],
        "prompts[0]: expected token ids in [0, 4096), got [99999]": ["--target", t, "--tokens", "99999"],
        "--threads: expected a positive int, got 0": ["--target", t, "--prompt", "x", "--threads", "0"],
        "generate: expected --prompt TEXT, --tokens IDS or --prompts-file FILE.jsonl": ["--target", t],
        "--prompts-file: expected a JSONL file": [
            "--target",
            t,
            "--prompts-file",
            str(tmp_path / "no.jsonl"),
        ],
        "the following arguments are required: --target": ["--prompt", "x"],
    }
    if "top_k" not in inspect.signature(fspec.generate).parameters:
        what = "fspec.stream" if hasattr(fspec, "stream") else "fspec.generate"  # one prompt streams
        cases[f"--top-k: this version's {what} does not take 'top_k'"] = [
            "--target",
            t,
            "--prompt",
            "x",
            "--top-k",
            "3",
        ]
    lines = {
        '{"prompt": "a"}\n{"prompt": ': ":2: expected one JSON object, got invalid JSON",
        '["a"]': ":1: expected an object with 'prompt' or 'messages'",
        '{"prompt": "a", "temp": 1}': ":1: unexpected keys ['temp']",
        '{"prompt": 5}': ":1: 'prompt': expected a string, got 5",
        '{"messages": []}': ":1: 'messages': expected a non-empty list",
        '{"prompt": "a", "seed": 1.5}': ":1: 'seed': expected an int, got 1.5",
        '{"prompt": "a", "temperature": "hot"}': ":1: 'temperature': expected a number, got 'hot'",
        '{"messages": [{"role": "user"}]}': "prompts[0]: messages[0]: expected a dict with str 'role'",
        "\n": "--prompts-file: expected at least one request",
    }
    for i, (text, says) in enumerate(lines.items()):
        file = tmp_path / f"bad{i}.jsonl"
        file.write_text(text)
        cases[says] = ["--target", t, "--prompts-file", str(file)]
    for says, argv in cases.items():
        assert main(["generate", *argv]) == 2, says
        out = capsys.readouterr()
        assert out.out == "" and out.err.count("\n") == 1 and out.err.startswith("fspec: error: "), (
            says,
            out,
        )
        assert says in out.err and "Traceback" not in out.err, (says, out.err)
    assert not bad.exists()


def test_single_prompt_streams_through_fspec_stream(toy_dirs, monkeypatch, capsys):
    """With fspec.stream present, one prompt without --json prints the deltas as they come (flushed, in
    order), passing the generate settings; --no-stream and --json fall back to fspec.generate."""
    t, _, _, _ = toy_dirs
    seen = {}

    def stream(target, draft, prompt, *, max_new_tokens, temperature, seed, compile):
        seen.update(prompt=prompt, max_new_tokens=max_new_tokens, temperature=temperature, draft=draft)
        for text, tokens, reason in (("Hel", [1, 2], None), ("lo", [3], "stop")):
            yield types.SimpleNamespace(text=text, tokens=tokens, finish_reason=reason)

    monkeypatch.setattr(fspec, "stream", stream, raising=False)
    argv = ["generate", "--target", t, "--prompt", "hi", "--chat", "--max-new-tokens", "5"]
    assert main(argv) == 0
    out = capsys.readouterr()
    assert out.out == "Hello\n" and "3 new tokens, finish reason stop" in out.err
    assert seen == dict(
        prompt=[{"role": "user", "content": "hi"}], max_new_tokens=5, temperature=0.0, draft=None
    )
    assert main(argv + ["--no-stream"]) == 0 and capsys.readouterr().out != "Hello\n"
    assert main(argv + ["--json"]) == 0 and json_lines(capsys.readouterr().out)[0]["index"] == 0


# --- fspec distill ------------------------------------------------------------------------------------------


def test_distill_help_shows_every_default(capsys):
    """`fspec distill --help` (and `fspec distill precompute --help`) print each optional option's default."""
    from fspec.cli import _distill_parsers

    for parser, argv in zip(_distill_parsers(), (["distill", "--help"], ["distill", "precompute", "--help"])):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 0
        text = " ".join(capsys.readouterr().out.split())
        for action in parser._actions:
            if action.required or action.dest == "help":
                continue
            assert f"(default: {action.default})" in text, action.dest
    assert main(["distill", "--out", "x"]) == 2  # --target missing: one line, exit code 2
    assert capsys.readouterr().err == "fspec: error: the following arguments are required: --target\n"


def test_distill_data_takes_a_text_file_or_a_directory(toy_dirs, tmp_path, capsys):
    """--data DIR: every UTF-8 file under it (sorted, recursively; binary files skipped), each followed by
    <|endoftext|>, is the token stream; `fspec distill --data` trains and writes a loadable head."""
    from fspec.cli import data_tokens

    t, _, target, _ = toy_dirs
    (tmp_path / "txt" / "sub").mkdir(parents=True)
    (tmp_path / "txt" / "a.py").write_text("def f(x):\n    return x + 1\n")
    (tmp_path / "txt" / "sub" / "b.txt").write_text("import os\nprint(os.sep)\n")
    (tmp_path / "txt" / "c.bin").write_bytes(b"\xff\xfe\x00")
    tok = target.tokenizer
    want = (
        tok.encode("def f(x):\n    return x + 1\n").ids
        + [0]
        + tok.encode("import os\nprint(os.sep)\n").ids
        + [0]
    )
    assert data_tokens(tmp_path / "txt", tok, 0).tolist() == want
    assert (
        data_tokens(tmp_path / "txt" / "a.py", tok, None).tolist()
        == tok.encode("def f(x):\n    return x + 1\n").ids
    )
    argv = ["distill", "--target", t, "--out", str(tmp_path / "head"), "--data", str(tmp_path / "txt")]
    argv += ["--steps", "1", "--batch-size", "1", "--seq-len", "8", "--ttt-steps", "1", "--no-progress"]
    assert main(argv + ["--draft-vocab-size", "64"]) == 0
    assert f"--data: {len(want)} tokens" in capsys.readouterr().err
    head = fspec.load_draft(tmp_path / "head", target=target)
    assert head.cfg.draft_vocab_size == 64 and "lm_head" not in head.shared
    assert main(argv + ["--draft-vocab-size", "64", "--tie-lm-head", "--out", str(tmp_path / "tied")]) == 0
    tied = fspec.load_draft(tmp_path / "tied", target=target)
    assert "lm_head" in tied.shared and tied.cfg.draft_vocab_size == 64
    assert main(["distill", "--target", t, "--out", "x", "--data", str(tmp_path / "none")]) == 2
    assert "fspec: error: --data: expected a text file or a directory of them" in capsys.readouterr().err
    assert main(argv + ["--tokens", "t.npy"]) == 2
    assert "--data: expected alone" in capsys.readouterr().err
