"""`kvtier eval-kv`: what each KV cache dtype costs in accuracy, over context lengths.

For every KV dtype and context length L, the same token windows of a text run through kvtier's
own runner twice -- once with the reference KV (the model dtype, float32 by default), once with
the KV dtype -- and the next-token distributions at the scored positions are compared:

    perplexity       exp(mean NLL of the text's next tokens)       (reference and each KV dtype)
    mean KL          mean over scored positions of KL(p_ref || p_kv) in nats
    top-1 agreement  fraction of scored positions with argmax p_ref == argmax p_kv

Windows are consecutive, non-overlapping slices of max(L) + 1 tokens of the tokenized text.
The scored tokens are the same for every L: the last S of each window (S = --score-tokens).
Context length L gives them the L - S + 1 .. L tokens before them, i.e. the sequence is the
window's last L + 1 tokens, run from position 0 (c_i below)::

    sequence for L:  c_0 ...................... c_{L-S-1} | c_{L-S} ......... c_{L-1} | c_L
                     [ one prefill from position 0, its KV   ][ S teacher-forced decode  ]
                     [ written into the paged pool in the KV ][ steps: step j feeds       ]
                     [ dtype                                 ][ c_{L-S+j} and is scored   ]
                                                              [ on predicting c_{L-S+j+1} ]

Each decode step reads the keys and values of every earlier position (and its own) from the
paged pool, exactly as a served decode step does: "context length L" is what the last scored
token attends over. With a quantized or down-cast KV dtype the runtime also makes the prefill
attend over the cache (kvtier.model.attention: a prefix hit must see what a recompute sees), so
the context's own hidden states carry the quantization error too, as in serving. The reference
runs the same steps with KV in the model dtype. Because the scored tokens do not change with L,
the reference perplexity across L shows how much the model uses longer context, and the drift
across L how the KV error grows with it.
"""

from __future__ import annotations

import gc
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvtier.engine.drift import divergence

DEFAULT_CONTEXT_LENGTHS = (128, 256, 512, 1024, 2048)


@dataclass(frozen=True)
class EvalKVConfig:
    """What `kvtier eval-kv` measures."""

    model: str
    """Hugging Face model directory."""
    text: str
    """A UTF-8 text file, tokenized whole with the model's tokenizer."""
    kv_dtypes: tuple[str, ...] | None = None
    """KV dtypes to compare (default: every one the runtime supports except the reference)."""
    context_lengths: tuple[int, ...] = DEFAULT_CONTEXT_LENGTHS
    dtype: str = "float32"
    """Model (weights and activations) dtype; the reference KV is this dtype."""
    score_tokens: int = 64
    """Scored positions per window and context length (teacher-forced decode steps)."""
    num_windows: int = 8
    """Token windows of the text (fewer if the text is shorter)."""
    block_size: int = 16
    """Tokens per KV block (quantized KV keeps one scale per block and KV head)."""
    device: str | None = None
    tokenizer: str | None = None
    """Tokenizer directory (default: the model directory)."""

    def __post_init__(self) -> None:
        if not self.context_lengths:
            raise ValueError("give at least one context length")
        if any(L < 2 for L in self.context_lengths):
            raise ValueError("context lengths must be >= 2")
        if self.score_tokens < 1 or self.score_tokens >= min(self.context_lengths):
            raise ValueError(
                f"--score-tokens must be in [1, {min(self.context_lengths) - 1}] (below the "
                f"shortest context length, {min(self.context_lengths)}); got {self.score_tokens}"
            )
        if self.num_windows < 1:
            raise ValueError("--num-windows must be >= 1")


@dataclass
class Row:
    """One (KV dtype, context length) cell."""

    kv_dtype: str
    context_length: int
    num_tokens: int
    ppl: float
    ppl_delta_pct: float
    """(ppl - reference ppl) / reference ppl, in percent."""
    mean_kl: float
    max_kl: float
    top1_agreement: float
    reference: bool = False


@dataclass
class EvalKVResult:
    config: dict[str, Any]
    reference_kv_dtype: str
    num_text_tokens: int
    num_windows: int
    rows: list[Row] = field(default_factory=list)
    seconds_by_kv_dtype: dict[str, float] = field(default_factory=dict)
    method: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "reference_kv_dtype": self.reference_kv_dtype,
            "num_text_tokens": self.num_text_tokens,
            "num_windows": self.num_windows,
            "method": self.method,
            "seconds_by_kv_dtype": self.seconds_by_kv_dtype,
            "rows": [asdict(r) for r in self.rows],
        }


def supported_kv_dtypes() -> tuple[str, ...]:
    """The KV dtype names the runtime accepts, 'auto' excluded."""
    from kvtier.model.kv_quant import KV_CACHE_DTYPES

    return tuple(d for d in KV_CACHE_DTYPES if d != "auto")


def evaluate_kv(cfg: EvalKVConfig, log=None) -> EvalKVResult:
    """Run the comparison (see the module docstring). `log(str)` gets progress lines."""
    from kvtier.model.loader import arch_config
    from kvtier.model.tokenizer import Tokenizer

    max_len = max(cfg.context_lengths)
    max_positions = arch_config(Path(cfg.model)).max_position_embeddings
    if max_len > max_positions:
        raise ValueError(
            f"context length {max_len} exceeds the model's {max_positions} positions; "
            f"use --context-lengths up to {max_positions}"
        )
    text = Path(cfg.text).read_text(encoding="utf-8")
    tok = Tokenizer(cfg.tokenizer or cfg.model)
    tokens = tok.encode(text)
    num_windows = min(cfg.num_windows, len(tokens) // (max_len + 1))
    if num_windows == 0:
        raise ValueError(
            f"{cfg.text} has {len(tokens)} tokens; context length {max_len} needs at least "
            f"{max_len + 1}: give a longer text or smaller --context-lengths"
        )
    windows = [tokens[i * (max_len + 1) : (i + 1) * (max_len + 1)] for i in range(num_windows)]
    if log and num_windows < cfg.num_windows:
        log(f"the text holds {num_windows} windows of {max_len + 1} tokens (asked for {cfg.num_windows})")

    ref_name = _dtype_name(cfg.dtype)
    kv_dtypes = list(cfg.kv_dtypes) if cfg.kv_dtypes else [d for d in supported_kv_dtypes() if d != ref_name]
    unknown = [d for d in kv_dtypes if d not in supported_kv_dtypes()]
    if unknown:
        raise ValueError(f"unknown KV dtype {unknown[0]!r}; this runtime supports {', '.join(supported_kv_dtypes())}")

    lengths = sorted(set(cfg.context_lengths))
    result = EvalKVResult(
        config={**asdict(cfg), "context_lengths": lengths, "kv_dtypes": kv_dtypes},
        reference_kv_dtype=ref_name,
        num_text_tokens=len(tokens),
        num_windows=num_windows,
        method=METHOD,
    )
    t0 = time.perf_counter()
    reference = _run(cfg, "auto", windows, lengths)
    result.seconds_by_kv_dtype[ref_name] = round(time.perf_counter() - t0, 2)
    ref_nll: dict[int, float] = {}
    for L in lengths:
        logits, targets = reference[L]
        ref_nll[L] = _mean_nll(logits, targets)
        result.rows.append(Row(ref_name, L, targets.numel(), math.exp(ref_nll[L]), 0.0, 0.0, 0.0, 1.0, reference=True))
    if log:
        log(f"reference KV {ref_name}: {result.seconds_by_kv_dtype[ref_name]} s")
    for kv in kv_dtypes:
        t0 = time.perf_counter()
        runs = _run(cfg, kv, windows, lengths)
        result.seconds_by_kv_dtype[kv] = round(time.perf_counter() - t0, 2)
        for L in lengths:
            logits, targets = runs[L]
            ref_logits = reference[L][0]
            kl, agree = divergence(ref_logits.flatten(0, 1), logits.flatten(0, 1))
            nll = _mean_nll(logits, targets)
            result.rows.append(
                Row(
                    kv,
                    L,
                    targets.numel(),
                    math.exp(nll),
                    100.0 * (math.exp(nll - ref_nll[L]) - 1.0),
                    float(kl.mean()),
                    float(kl.max()),
                    float(agree.double().mean()),
                )
            )
        if log:
            log(f"KV {kv}: {result.seconds_by_kv_dtype[kv]} s")
    return result


METHOD = (
    "the last S tokens of each window are scored (S = score_tokens), the same for every L; for context "
    "length L the window's last L+1 tokens run from position 0: one prefill of L-S tokens (KV written into "
    "the paged pool in the KV dtype), then S teacher-forced decode steps that read all earlier KV from the "
    "pool; reference = KV in the model dtype"
)


def _run(
    cfg: EvalKVConfig, kv_dtype: str, windows: list[list[int]], lengths: list[int]
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """L -> (logits [W, S, vocab] float32 on CPU, targets [W, S]) with KV dtype `kv_dtype`."""
    from kvtier.model.runner import ModelRunner
    from kvtier.sched.output import ScheduledSeq, SchedulerOutput

    bs, S = cfg.block_size, cfg.score_tokens
    blocks_per_window = -(-max(lengths) // bs)
    runner = ModelRunner(
        cfg.model,
        dtype=cfg.dtype,
        device=cfg.device,
        block_size=bs,
        num_blocks=len(windows) * blocks_per_window,
        seed=0,
        kv_cache_dtype=kv_dtype,
    )
    tables = [list(range(w * blocks_per_window, (w + 1) * blocks_per_window)) for w in range(len(windows))]
    out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for L in lengths:
        seqs_L = [win[len(win) - (L + 1) :] for win in windows]  # the last L + 1 tokens
        prefix = L - S
        for w, seq in enumerate(seqs_L):  # one prefill per window: memory stays one window's
            runner.execute(SchedulerOutput(seqs=[ScheduledSeq(f"w{w}", seq[:prefix], 0, tables[w], False)]))
        steps = []
        for j in range(S):
            pos = prefix + j
            batch = [ScheduledSeq(f"w{w}", [seq[pos]], pos, tables[w], True) for w, seq in enumerate(seqs_L)]
            steps.append(runner.execute(SchedulerOutput(seqs=batch)).float().cpu())  # [W, vocab]
        logits = torch.stack(steps, dim=1)  # [W, S, vocab]
        targets = torch.tensor([seq[prefix + 1 :] for seq in seqs_L], dtype=torch.long)
        out[L] = (logits, targets)
    del runner
    gc.collect()
    return out


def _mean_nll(logits: torch.Tensor, targets: torch.Tensor) -> float:
    lp = torch.log_softmax(logits.double(), dim=-1)
    return -float(lp.gather(-1, targets[..., None]).mean())


def _dtype_name(dtype: str) -> str:
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"--dtype must be float32, bfloat16 or float16 (the reference KV dtype), got {dtype!r}")
    return dtype


# -- output ---------------------------------------------------------------------------------------


def format_table(result: EvalKVResult) -> str:
    cfg = result.config
    lines = [
        f"model {cfg['model']} ({cfg['dtype']}), reference KV {result.reference_kv_dtype}, block size "
        f"{cfg['block_size']}; {result.num_windows} windows x {cfg['score_tokens']} scored tokens per "
        f"context length ({result.num_text_tokens} text tokens)",
        f"{'kv_dtype':<10} {'context':>7} {'ppl':>9} {'dppl%':>8} {'mean_kl':>10} {'max_kl':>10} {'top1':>7}",
    ]
    for r in sorted(result.rows, key=lambda r: (not r.reference, _order(r.kv_dtype, cfg), r.context_length)):
        name = r.kv_dtype + ("*" if r.reference else "")
        lines.append(
            f"{name:<10} {r.context_length:>7} {r.ppl:>9.4f} {r.ppl_delta_pct:>+8.3f} "
            f"{r.mean_kl:>10.3e} {r.max_kl:>10.3e} {r.top1_agreement:>7.4f}"
        )
    lines.append(
        "* reference. mean_kl/max_kl: KL(reference || kv_dtype) in nats per scored token; "
        "top1: argmax agreement with the reference"
    )
    return "\n".join(lines)


def _order(name: str, cfg: dict) -> int:
    order = cfg["kv_dtypes"]
    return order.index(name) if name in order else -1


def plot(result: EvalKVResult, path: str) -> None:
    """Perplexity change, mean KL and top-1 agreement against context length, one line per KV
    dtype (the reference's perplexity in the first panel's legend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_dtype: dict[str, list[Row]] = {}
    for r in result.rows:
        by_dtype.setdefault(r.kv_dtype, []).append(r)
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2))
    xs: list[int] = []
    for name, rows in by_dtype.items():
        rows.sort(key=lambda r: r.context_length)
        xs = [r.context_length for r in rows]
        if rows[0].reference:
            ppl = ", ".join(f"{r.ppl:.3g}" for r in rows)
            axes[0].axhline(0.0, color="black", ls="--", label=f"{name} KV (reference): ppl {ppl}")
            continue
        axes[0].plot(xs, [r.ppl_delta_pct for r in rows], marker="o", label=name)
        axes[1].plot(xs, [max(r.mean_kl, 1e-12) for r in rows], marker="o", label=name)
        axes[2].plot(xs, [r.top1_agreement for r in rows], marker="o", label=name)
    cfg = result.config
    titles = (
        "perplexity change vs reference, %",
        f"mean KL({result.reference_kv_dtype} KV || KV dtype), nats",
        "top-1 agreement with the reference",
    )
    for ax, title in zip(axes, titles):
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("context length (tokens)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[1].set_yscale("log")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 6), fontsize=8, frameon=False)
    fig.suptitle(
        f"{Path(cfg['model']).name}: {result.num_windows} windows x {cfg['score_tokens']} scored "
        f"decode tokens per length, block size {cfg['block_size']}",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
