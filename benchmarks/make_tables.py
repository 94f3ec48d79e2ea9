"""Render the markdown tables of BENCHMARKS.md from benchmarks/results/*.json.

python benchmarks/make_tables.py [NAME ...]      # attention, sampling, draft_loop, generate
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def _f(x, fmt: str = "{:.1f}") -> str:
    return fmt.format(x) if isinstance(x, (int, float)) else "-"


def attention(d: dict) -> list[str]:
    out = [
        "| B | ctx | query rows | floor µs | fspec µs (graph) | best swept µs | FlexAttention µs | SDPA + gather µs "
        "| fspec / floor | fspec / best baseline |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in d["rows"]:
        c = r["case"]
        base = [x for x in (r.get("flex_us"), r.get("sdpa_gather_us")) if isinstance(x, (int, float))]
        flex = _f(r.get("flex_us")) if r.get("flex_us") else "failed to compile"
        out.append(
            f"| {c['B']} | {c['ctx']} | {c['num_query']} | {_f(r['floor_us'])} | {_f(r['fspec_graph_us'])} "
            f"| {_f(r.get('fspec_best_us'))} | {flex} | {_f(r.get('sdpa_gather_us'))} "
            f"| {r['fspec_graph_us'] / r['floor_us']:.2f} | {r['fspec_graph_us'] / min(base):.2f} |"
        )
    return out


def sampling(d: dict) -> list[str]:
    out = [
        "| op | B | V | floor µs | fspec, graph µs | fspec, eager µs | fspec launch, eager µs "
        "| vLLM Gumbel, eager µs (reported) | exponential race, graph µs "
        "| exponential race, eager µs | torch.multinomial, graph µs | torch.multinomial, eager µs "
        "| PyTorch reference, eager µs | fspec graph / floor |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in d["rows"]:
        c = r["case"]
        out.append(
            f"| {c['op']} | {c['B']} | {c['V']} | {_f(r['floor_us'])} | {_f(r['fspec_graph_us'])} "
            f"| {_f(r['fspec_us'])} | {_f(r.get('fspec_launch_us'))} | {_f(r.get('vllm_reported_eager_us'))} "
            f"| {_f(r.get('exponential_race_graph_us'))} "
            f"| {_f(r.get('exponential_race_us'))} | {_f(r.get('torch_multinomial_graph_us'))} "
            f"| {_f(r.get('torch_multinomial_us'))} | {_f(r['ref_eager_us'], '{:.0f}')} "
            f"| {r['fspec_graph_us'] / max(r['floor_us'], 1e-9):.1f} |"
        )
    return out


def sampling_blocks(d: dict) -> list[str]:
    """The tokens-per-program sweep of bench_sampling.py --blocks: graph replay µs per block size."""
    blocks = sorted({r["block"] for r in d["block_sweep"]})
    cases: dict[tuple, dict] = {}
    for r in d["block_sweep"]:
        case = cases.setdefault((r["op"], r["B"], r["V"]), {"floor": r["floor_us"]})
        case[r["block"]] = r["fspec_graph_us"]
    out = [
        "| op | B | V | floor µs | " + " | ".join(f"{b} tokens, graph µs" for b in blocks) + " | fastest |",
        "|---|---:|---:|---:|" + "---:|" * len(blocks) + "---:|",
    ]
    for (op, b, v), t in cases.items():
        best = min(blocks, key=lambda k: t.get(k, float("inf")))
        cells = " | ".join(_f(t.get(k)) for k in blocks)
        out.append(f"| {op} | {b} | {v} | {_f(t['floor'])} | {cells} | {best} |")
    return out


def draft_loop(d: dict) -> list[str]:
    out = [
        "| head | B | K | floor µs/step | compiled whole loop µs/step | whole loop, back to back µs/step "
        "| host µs/call | compiled per-step replay µs/step | eager µs/step | loop / floor "
        "| back to back / floor | eager / loop |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in d["rows"]:
        c = r["case"]
        b2b = r.get("compiled_loop_back_to_back_us")
        b2b_ratio = b2b / r["floor_us"] if b2b else None
        out.append(
            f"| {c['head']} | {c['B']} | {c['K']} | {_f(r['floor_us'])} | {_f(r['compiled_loop_us'])} "
            f"| {_f(b2b)} | {_f(r.get('compiled_loop_host_us_per_call'))} "
            f"| {_f(r.get('compiled_step_us'))} | {_f(r['eager_us'])} | {_f(r['loop_over_floor'], '{:.2f}')} "
            f"| {_f(b2b_ratio, '{:.2f}')} | {_f(r['eager_over_loop'], '{:.1f}')} |"
        )
    return out


def generate(d: dict) -> list[str]:
    out = [
        "| system | B | K | tokens/s | τ | floor tokens/s | of floor | round model µs | round graph µs | round measured µs | note |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in d["rows"]:
        c = r["case"]
        out.append(
            f"| {c.get('system')} | {c.get('B')} | {c.get('K') or '-'} | {_f(r.get('tokens_per_s'))} "
            f"| {_f(r.get('acceptance_length'), '{:.2f}')} | {_f(r.get('floor_tokens_per_s'))} "
            f"| {_f(r.get('ratio_to_floor'), '{:.2f}')} | {_f(r.get('round_model_us'))} | {_f(r.get('round_graph_us'))} "
            f"| {_f(r.get('round_measured_us'))} | {(r.get('error') or '')[:60]} |"
        )
    return out


def acceptance(d: dict) -> list[str]:
    out = [
        "| head | temperature | K | τ measured | (1 − α^{K+1}) / (1 − α), α from K = 1 | 1 + Σ Π α_i (K = 7 rates) | per-position acceptance |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in d["rows"]:
        c = r["case"]
        rates = ", ".join(f"{a:.2f}" for a in r["acceptance_rate_per_position"])
        out.append(
            f"| {c['head']} | {c['temperature']} | {c['K']} | {r['acceptance_length']:.2f} | {r['theory_iid']:.2f} "
            f"| {r['theory_per_position']:.2f} | {rates} |"
        )
    return out


def call_overhead(d: dict) -> list[str]:
    out = [
        "| case | Python GC | median ms | min ms | max ms | tokens/s (median) | ms in GC, all calls | phases of one call (ms) |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in d["rows"]:
        ph = d["phases_s"][r["case"]]
        phases = (
            f"setup {ph['setup'] * 1e3:.1f}, prefill {ph['prefill'] * 1e3:.1f}, rounds {ph['rounds'] * 1e3:.1f} "
            f"({ph['rounds_launched']} rounds)"
        )
        out.append(
            f"| {r['case']} | {r['gc']} | {r['median_s'] * 1e3:.1f} | {r['min_s'] * 1e3:.1f} | {r['max_s'] * 1e3:.1f} "
            f"| {r['tokens_per_s_median']:.0f} | {r['gc_seconds_total'] * 1e3:.1f} | {phases} |"
        )
    return out


def dispatch(d: dict) -> list[str]:
    out = [
        "| op | through torch.ops.fspec µs | fspec's call (direct) µs | saved µs |",
        "|---|---:|---:|---:|",
    ]
    for r in d["rows"]:
        saved = r["dispatcher_us"] - r["direct_us"]
        out.append(f"| {r['op']} | {_f(r['dispatcher_us'])} | {_f(r['direct_us'])} | {_f(saved)} |")
    return out


def skinny_linear(d: dict) -> list[str]:
    out = [
        "| projection | N × K | M | floor µs | cuBLAS µs | skinny (default) µs | best skinny µs | best config "
        "| cuBLAS / floor | best / floor |",
        "|---|---|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in d["rows"]:
        best = r.get("best_config")
        cfg = (
            f"{best['block_n']}×{best['block_k']}, {best['num_warps']}w{best['num_stages']}s"
            + (" CUDA cores" if best.get("fma") else "")
            + (", one tile" if best.get("one_tile") else "")
            + (f", split {best['split_k']}" if best.get("split_k", 1) > 1 else "")
            if best
            else "-"
        )
        out.append(
            f"| {r['shape']} | {r['N']} × {r['K']} | {r['M']} | {_f(r.get('floor_us'), '{:.2f}')} "
            f"| {_f(r['cublas_us'], '{:.2f}')} | {_f(r['skinny_us'], '{:.2f}')} | {_f(r.get('best_us'), '{:.2f}')} "
            f"| {cfg} | {_f(r.get('cublas_over_floor'), '{:.2f}')} | {_f(r.get('best_over_floor'), '{:.2f}')} |"
        )
    return out


def skinny_fusions(d: dict) -> list[str]:
    out = [
        "| projection | fusions | N × K | floor µs | fused, tensor-core tile µs | fused, one-row CUDA-core µs "
        "| plain skinny (default) µs | cuBLAS µs | best fused / floor |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in d["rows"]:
        # files before the one-row default: fused_us is the tile, fused_fma_us the one-row kernel; after it
        # fused_us is the (one-row) default and fused_tile_us the tile
        tile = r.get("fused_tile_us", r["fused_us"] if "fused_fma_us" in r else None)
        row = r.get("fused_fma_us", r["fused_us"] if "fused_tile_us" in r else None)
        best = min(t for t in (tile, row) if t is not None)
        floor = r.get("floor_us")
        out.append(
            f"| {r['shape']} | {r['fusion']} | {r['N']} × {r['K']} | {_f(floor, '{:.2f}')} "
            f"| {_f(tile, '{:.2f}')} | {_f(row, '{:.2f}')} "
            f"| {_f(r['skinny_us'], '{:.2f}')} | {_f(r['cublas_us'], '{:.2f}')} "
            f"| {_f(best / floor if floor else None, '{:.2f}')} |"
        )
    return out


def host_overhead(d: dict) -> list[str]:
    names = ["empty", "scratch", "launch_block", "launch_block_compiled", "launch_reduce", "launch_probs"]
    names += ["launch_finish"]
    names += ["launcher", "call", "op", "validate", "public"]
    names = [n for n in names if any(f"{n}_us" in r for r in d["rows"])]  # columns added since older runs
    out = ["| B | V | " + " | ".join(f"{n} µs" for n in names) + " |", "|---:|---:|" + "---:|" * len(names)]
    for r in d["rows"]:
        out.append(f"| {r['B']} | {r['V']} | " + " | ".join(_f(r.get(f"{n}_us")) for n in names) + " |")
    return out


acceptance_h200 = acceptance  # the same sweep, run on the GPU host (its Python's held-out files)


def distill_scaling(d: dict) -> list[str]:
    t, e, n = d["throughput"], d["equality"], d["gpus"]
    return [
        "| run | GPUs | global batch × seq | tokens/s | s/step | scaling |",
        "|---|---:|---|---:|---:|---:|",
        f"| throughput, bf16 autocast | 1 | {d['global_batch']} × {d['seq_len']} | {t['1']['tokens_per_s']:,.0f} "
        f"| {t['1']['s_per_step']:.3f} | 1.00 |",
        f"| throughput, bf16 autocast | {n} | {d['global_batch']} × {d['seq_len']} "
        f"| {t[str(n)]['tokens_per_s']:,.0f} | {t[str(n)]['s_per_step']:.3f} | {t['scaling']:.2f} |",
        "",
        "| equality after N steps | global batch × seq | max abs diff | ‖θ₁ − θ₂‖ / ‖θ₁ − θ₀‖ | loss, 1 GPU | "
        f"loss, {n} GPUs |",
        "|---|---|---:|---:|---:|---:|",
        f"| {e['steps']} steps, {e['dtype']} | {e['global_batch']} × {e['seq_len']} | {e['max_abs_diff']:.2e} "
        f"| {e['relative_distance']:.2e} | {e['loss_1']:.6f} | {e[f'loss_{n}']:.6f} |",
    ]


def ttt_memory(d: dict) -> list[str]:
    out = [
        "| head shapes | B × S | Vd | K | dense attention + plain CE, GB | + lean attention, GB "
        "| + lean CE, GB | + fused lm_head CE (default), GB | reduction |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in d["rows"]:
        out.append(
            f"| {r['head']} | {r['batch']} × {r['seq_len']} | {r['draft_vocab']} | {r['ttt_steps']} "
            f"| {r['dense_GB']:.1f} | {r['lean_attention_GB']:.1f} | {r['lean_attention_and_ce_GB']:.1f} "
            f"| {r['fused_ce_GB']:.1f} | {r['reduction']:.2f}× |"
        )
    return out


def switches(d: dict) -> list[str]:
    out = [
        "| run | variant | switches | 8B head µs/step (floor) | 8B / floor | 1B head µs/step (floor) | 1B / floor "
        "| full acceptance tok/s | target-only tok/s |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in d["rows"]:
        env = ", ".join(f"{k}={v}" for k, v in r["env"].items()) or "none"
        out.append(
            f"| {r['run']} | {r['variant']} | {env} | {_f(r['8b_back_to_back_us'])} ({_f(r['8b_floor_us'])}) "
            f"| {r['8b_back_to_back_over_floor']:.3f} | {_f(r['1b_back_to_back_us'])} ({_f(r['1b_floor_us'])}) "
            f"| {r['1b_back_to_back_over_floor']:.3f} | {_f(r.get('forced_tokens_per_s'), '{:.0f}')} "
            f"| {_f(r.get('target_tokens_per_s'), '{:.0f}')} |"
        )
    return out


def l2_prefetch(d: dict) -> list[str]:
    out = [
        f"| weight | MiB | floor µs | case | fraction prefetched | µs (idle {d['idle_us']:.0f} µs before) |",
        "|---|---:|---:|---|---:|---:|",
    ]
    for r in d["rows"]:
        out.append(
            f"| {r['shape']} | {r['weight_mib']:.0f} | {_f(r['floor_us'], '{:.2f}')} | {r['case']} "
            f"| {r['fraction']:.2f} | {_f(r['us'], '{:.2f}')} |"
        )
    return out


ALIASES = {
    "skinny_linear_one_row": "skinny_linear",
    "draft_loop_b1_b32": "draft_loop",
    "host_overhead_torch_checks": "host_overhead",
    "draft_loop_b1_b32_rows": "draft_loop",
    "draft_loop_b1": "draft_loop",
    "draft_loop_cuda_graph": "draft_loop",
    "draft_loop_b1_cuda_graph": "draft_loop",
    "draft_loop_b1_1b": "draft_loop",
    "draft_loop_b1_1b_cuda_graph": "draft_loop",
    "switches_m": "switches",
}  # result files drawn by another's renderer


NAMES = [
    "attention",
    "sampling",
    "sampling_blocks",
    "draft_loop",
    "draft_loop_b1_b32",
    "draft_loop_b1_b32_rows",
    "draft_loop_b1",
    "draft_loop_cuda_graph",
    "draft_loop_b1_cuda_graph",
    "draft_loop_b1_1b",
    "draft_loop_b1_1b_cuda_graph",
    "generate",
    "call_overhead",
    "skinny_linear",
    "skinny_linear_one_row",
    "skinny_fusions",
    "host_overhead",
    "host_overhead_torch_checks",
    "switches",
    "switches_m",
    "l2_prefetch",
    "dispatch",
    "acceptance",
    "acceptance_h200",
    "distill_scaling",
    "ttt_memory",
]


def section(name: str, results: Path = RESULTS) -> str | None:
    """The `### name` section of BENCHMARKS.md for results/<name>.json (None when the file is absent):
    heading, the command with machine, versions and date, and the table."""
    path = results / f"{name}.json"
    if not path.exists():
        return None
    d = json.loads(path.read_text())
    bw = f", copy bandwidth {d['copy_bandwidth_TBps']} TB/s" if d.get("copy_bandwidth_TBps") else ""
    machine = d["machine"] if d.get("device", "cpu") == "cpu" else f"{d['device']} ({d['machine']})"
    head = f"### {name}\n\n`{d['command'].strip()}` — {machine}, torch {d['torch']}, triton {d['triton']}, {d['date']}{bw}\n"
    render = globals()[ALIASES.get(name, name)]
    return head + "\n" + "\n".join(render(d)) + "\n"


def main(names: list[str]) -> int:
    for name in names or NAMES:
        text = section(name)
        if text is not None:
            print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
