"""Dump Inductor's generated code around the custom ops of one compiled target decode step (CUDA only).

    python benchmarks/dump_decode_code.py OUT_DIR

Llama-3.2-1B shape (random weights, bf16, fused projections), B = 1, context 150: writes
OUT_DIR/decode_kernels.txt with the Triton kernels whose names mention paged_attention and the graph's `call`
body, where one sees which kernels run in front of each layer's custom ops (this is how the per-layer
recomputation of the step metadata was found; `fspec::step_metadata`, kernels/step_metadata.py, is the fix).
"""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from bench_generate import llama_1b_config  # noqa: E402

import fspec  # noqa: E402
from fspec.models import llama  # noqa: E402
from fspec.serve import rounds  # noqa: E402
from fspec.serve.resources import Resources  # noqa: E402

KERNEL = re.compile(r"(triton_\w*paged_attention\w*) = async_compile\.triton\((.*?)''', device_str", re.S)


def main(out_dir: str) -> int:
    if not torch.cuda.is_available():
        print("dump_decode_code.py needs a CUDA device; nothing to do here.")
        return 0
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = llama_1b_config(400)
    params = fspec.fuse_projections(llama.init(cfg, seed=0, dtype=torch.bfloat16, device="cuda"))
    cache = Resources().cache(cfg, 32, 16, torch.bfloat16, torch.device("cuda"), True)
    step = rounds.compiled_decode_step(cfg, 16, 400)
    cuda = {"device": "cuda"}
    table = torch.arange(25, dtype=torch.int32, **cuda)[None, :]
    cur, n, live = torch.tensor([5], **cuda), torch.tensor([150], **cuda), torch.tensor([True], **cuda)
    sampling = fspec.SamplingParams.create(1, device="cuda")
    full = out / "output_code_full.txt"
    handler = logging.FileHandler(full)
    torch._logging.set_logs(output_code=True)
    logging.getLogger("torch._inductor").addHandler(handler)
    torch.compiler.cudagraph_mark_step_begin()
    step(params, cur, n, live, table, sampling, cache)
    torch.cuda.synchronize()
    handler.close()
    text = full.read_text()
    kernels = [f"{m.group(1)}\n{m.group(2)[:4000]}" for m in KERNEL.finditer(text)]
    call = text[text.find("def call(args):") :][:20000]
    (out / "decode_kernels.txt").write_text("\n\n=====\n".join(kernels[:4]) + "\n\n===== CALL\n" + call)
    full.unlink()
    print(f"kernels with paged_attention in the name: {len(kernels)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "."))
