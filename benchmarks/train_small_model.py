"""Train a small Llama-architecture model on generated text, so that KV-precision studies
(`kvtier eval-kv`, the drift monitor) have trained weights to measure: drift numbers on random
weights mean nothing.

    python benchmarks/train_small_model.py --out /tmp/kvtier-trained    # 14 min on 1 shared CPU thread
    python benchmarks/train_small_model.py --out /tmp/kvtier-trained --check-only   # checks only

The text is generated here (no download, no licence question): a toy language whose documents
need their context. Each document introduces people one at a time with facts about them
(home, favourite colour, how many of some thing they own, a friend), then keeps going with
filler sentences, questions whose answers are facts stated earlier (possibly 1000+ tokens back),
and "recall :" passages that repeat an earlier span verbatim (copying / induction)::

    kelami lives in orvane . kelami likes the color teal . kelami has seven lamps .
    the quiet farmer carries a lamp near the river . ...
    question : where does kelami live ? answer : kelami lives in orvane .
    recall : the quiet farmer carries a lamp near the river .

People's names are fresh per document (random syllables), so their facts can only come from
the context. A byte-level BPE (`tokenizers`, vocabulary 1024) is trained on the same text.

Writes to --out: config.json + model.safetensors (transformers `save_pretrained`, float32),
tokenizer.json + tokenizer_config.json (kvtier's loader reads them), eval.txt (held-out
documents from another seed, each longer than 2048 tokens) and train_log.json. Prints JSON:
train loss, held-out loss over 256 / 1024 / 2048 tokens, answer accuracy (teacher-forced: does
the model retrieve the fact?) and a parity check (kvtier's greedy tokens == transformers').
Deterministic for a given --seed and thread count (the schedule counts steps, not seconds).
Measured results: docs/benchmarks.md, "KV dtype accuracy" (with the default 1,100 steps the
model learns the language's local structure and a little context use, not retrieval: answers
come out at chance).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # kvtier from this checkout

# -- the generated language -----------------------------------------------------------------------

NOUNS = (
    "lamp",
    "goat",
    "boat",
    "stone",
    "drum",
    "coat",
    "cup",
    "map",
    "key",
    "horse",
    "apple",
    "book",
    "bell",
    "chair",
    "basket",
    "rope",
    "knife",
    "kettle",
    "mirror",
    "ladder",
    "candle",
    "shell",
    "feather",
    "wheel",
    "blanket",
    "bottle",
    "hammer",
    "flute",
    "ring",
    "letter",
)
ADJECTIVES = (
    "quiet",
    "old",
    "young",
    "tired",
    "clever",
    "tall",
    "small",
    "bright",
    "heavy",
    "gentle",
    "angry",
    "happy",
    "careful",
    "strange",
    "busy",
    "brave",
)
ROLES = (
    "farmer",
    "baker",
    "sailor",
    "teacher",
    "child",
    "miller",
    "weaver",
    "smith",
    "doctor",
    "singer",
    "merchant",
    "guard",
)
VERBS = (
    "carries",
    "finds",
    "cleans",
    "sells",
    "paints",
    "hides",
    "mends",
    "watches",
    "drops",
    "counts",
    "buys",
    "opens",
)
PREPS = ("near", "under", "beside", "behind", "past", "across")
SCENES = (
    "the river",
    "the market",
    "the old mill",
    "the bridge",
    "the hill",
    "the harbor",
    "the forest",
    "the gate",
    "the well",
    "the square",
)
PLACES = (
    "orvane",
    "tessik",
    "mardol",
    "ulbrin",
    "kavoss",
    "peldra",
    "zunmar",
    "hollow creek",
    "east ferry",
    "stone hill",
    "red harbor",
    "miller's end",
)
COLORS = ("red", "blue", "green", "teal", "amber", "violet", "gray", "white", "black", "gold", "orange", "pink")
NUMBERS = ("two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve")
SYLLABLES = tuple(c + v for c in "bdfgklmnprstvz" for v in "aeiou") + ("ran", "tel", "mor", "vin", "sal")


class Person:
    def __init__(self, rng: random.Random, used: set[str]) -> None:
        while True:
            name = "".join(rng.choice(SYLLABLES) for _ in range(rng.choice((2, 2, 3))))
            if name not in used:
                break
        used.add(name)
        self.name = name
        self.home = rng.choice(PLACES)
        self.color = rng.choice(COLORS)
        self.count = rng.choice(NUMBERS)
        self.thing = rng.choice(NOUNS)
        self.friend: Person | None = None

    def facts(self) -> list[str]:
        out = [
            f"{self.name} lives in {self.home} .",
            f"{self.name} likes the color {self.color} .",
            f"{self.name} has {self.count} {self.thing}s .",
        ]
        if self.friend is not None:
            out.append(f"{self.name} is a friend of {self.friend.name} .")
        return out

    def question(self, rng: random.Random) -> str:
        kinds = ["home", "color", "count"] + (["friend"] if self.friend is not None else [])
        kind = rng.choice(kinds)
        n = self.name
        if kind == "home":
            return f"question : where does {n} live ? answer : {n} lives in {self.home} ."
        if kind == "color":
            return f"question : what color does {n} like ? answer : {self.color} ."
        if kind == "count":
            return f"question : how many {self.thing}s does {n} have ? answer : {self.count} {self.thing}s ."
        return f"question : who is the friend of {n} ? answer : {self.friend.name} ."


def _filler(rng: random.Random, people: list[Person]) -> str:
    subject = (
        rng.choice(people).name
        if people and rng.random() < 0.4
        else f"the {rng.choice(ADJECTIVES)} {rng.choice(ROLES)}"
    )
    obj = f"{rng.choice(('a', 'the'))} {rng.choice(NOUNS)}"
    tail = f" {rng.choice(PREPS)} {rng.choice(SCENES)}" if rng.random() < 0.7 else ""
    return f"{subject} {rng.choice(VERBS)} {obj}{tail} ."


def generate_document(rng: random.Random, num_words: int) -> str:
    """One document of about `num_words` words (see the module docstring)."""
    people: list[Person] = []
    used: set[str] = set()
    sentences: list[str] = []
    words = 0
    while words < num_words:
        r = rng.random()
        if not people or (r < 0.10 and len(people) < 24):
            p = Person(rng, used)
            if people and rng.random() < 0.6:
                p.friend = rng.choice(people)
            people.append(p)
            new = p.facts()
            rng.shuffle(new)
        elif r < 0.40:
            # ask about anyone introduced so far: old people as often as recent ones
            new = [rng.choice(people).question(rng)]
        elif r < 0.65 and len(sentences) > 8:
            # repeat an earlier span verbatim: copying is the first thing that needs the context
            start = rng.randrange(0, len(sentences) - 4)
            span = sentences[start : start + rng.randint(3, 8)]
            new = ["recall : " + " ".join(s for s in span if not s.startswith("recall"))]
        else:
            new = [_filler(rng, people)]
        for s in new:
            sentences.append(s)
            words += s.count(" ") + 1
    return " ".join(sentences)


def generate_corpus(seed: int, num_docs: int, words_per_doc: tuple[int, int]) -> list[str]:
    rng = random.Random(seed)
    return [generate_document(rng, rng.randint(*words_per_doc)) for _ in range(num_docs)]


# -- tokenizer -------------------------------------------------------------------------------------


def train_tokenizer(docs: list[str], vocab_size: int, out_dir: Path):
    """Byte-level BPE with <s> (bos, prepended on encode), </s> (eos) and <pad>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": "</s>",
                "pad_token": "<pad>",
                "model_max_length": 4096,
                "tokenizer_class": "PreTrainedTokenizerFast",
                "add_bos_token": True,
            },
            indent=2,
        )
        + "\n"
    )
    return tok


# -- training --------------------------------------------------------------------------------------


def build_model(vocab_size: int, args: argparse.Namespace, bos: int, eos: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=64,
        max_position_embeddings=args.max_positions,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=None,
        attn_implementation="sdpa",
    )
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(config).to(torch.float32)


def batches(stream: list[list[int]], seq_len: int, batch_size: int, rng: random.Random):
    """Endless batches of `seq_len + 1` tokens: a document from its start when it is long enough
    (so its facts are in the window), else documents concatenated."""
    import torch

    while True:
        rows = []
        for _ in range(batch_size):
            doc = rng.randrange(len(stream))
            row: list[int] = []
            while len(row) < seq_len + 1:
                row += stream[doc]
                doc = (doc + 1) % len(stream)
            rows.append(row[: seq_len + 1])
        t = torch.tensor(rows, dtype=torch.long)
        yield t[:, :-1], t[:, 1:]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="/tmp/kvtier-trained", help="checkpoint directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: on a shared machine two threads lose more to waiting than they gain)",
    )
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8, help="query heads (head_dim 64)")
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--max-positions", type=int, default=4096)
    p.add_argument("--train-docs", type=int, default=1500)
    p.add_argument("--eval-docs", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3, help="peak; warmup, then cosine to 10%%")
    p.add_argument("--warmup-steps", type=int, default=30)
    # phases of SEQxBATCHxSTEPS: short windows for speed, then long ones so that positions up
    # to 2048 are trained
    p.add_argument(
        "--phases",
        default="256x4x800,1024x1x200,2048x1x100",
        help="comma-separated SEQxBATCHxSTEPS training phases, in order",
    )
    p.add_argument(
        "--check-only",
        action="store_true",
        help="skip training: check that kvtier's greedy output on --out equals transformers'",
    )
    args = p.parse_args(argv)

    import torch

    if args.check_only:
        from tokenizers import Tokenizer
        from transformers import LlamaForCausalLM

        torch.set_num_threads(args.threads)
        out = Path(args.out)
        model = LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
        tok = Tokenizer.from_file(str(out / "tokenizer.json"))
        eval_docs = (out / "eval.txt").read_text().strip().split("\n\n")
        print(json.dumps({**answer_accuracy(model, tok, eval_docs), **parity_check(out)}))
        return 0

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    train_docs = generate_corpus(args.seed, args.train_docs, (700, 2000))
    eval_docs = generate_corpus(args.seed + 1_000_003, args.eval_docs, (2200, 2600))
    tok = train_tokenizer(train_docs, args.vocab, out)
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    stream = [[bos] + tok.encode(d, add_special_tokens=False).ids + [eos] for d in train_docs]
    num_train_tokens = sum(map(len, stream))
    (out / "eval.txt").write_text("\n\n".join(eval_docs) + "\n")
    eval_ids = [[bos] + tok.encode(d, add_special_tokens=False).ids for d in eval_docs]

    model = build_model(tok.get_vocab_size(), args, bos, eos)
    num_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.98),
        eps=1e-8,
    )
    rng = random.Random(args.seed)
    phases = [tuple(int(x) for x in spec.split("x")) for spec in args.phases.split(",")]
    total_steps = sum(n for _, _, n in phases)

    log: list[dict] = []
    step = 0
    tokens_seen = 0
    t_train = time.perf_counter()
    model.train()
    for seq_len, batch_size, num_steps in phases:
        it = batches(stream, seq_len, batch_size, rng)
        ema = None
        for _ in range(num_steps):
            progress = step / total_steps
            lr = args.lr * min(1.0, (step + 1) / args.warmup_steps) * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))
            for g in opt.param_groups:
                g["lr"] = lr
            x, y = next(it)
            logits = model(input_ids=x).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            tokens_seen += x.numel()
            ema = loss.item() if ema is None else 0.9 * ema + 0.1 * loss.item()
            if step % 25 == 0 or step == total_steps:
                entry = {
                    "step": step,
                    "seq_len": seq_len,
                    "elapsed_s": round(time.perf_counter() - t_train, 1),
                    "lr": round(lr, 6),
                    "loss": round(ema, 4),
                }
                log.append(entry)
                print(json.dumps(entry), file=sys.stderr, flush=True)
    train_s = time.perf_counter() - t_train

    model.eval()
    eval_result = evaluate(model, eval_ids, (256, 1024, 2048))
    eval_result.update(answer_accuracy(model, tok, eval_docs))
    model.save_pretrained(out, safe_serialization=True)
    eval_result.update(parity_check(out))
    summary = {
        "out": str(out),
        "seed": args.seed,
        "threads": args.threads,
        "num_params": num_params,
        "layers": args.layers,
        "hidden": args.hidden,
        "heads": args.heads,
        "kv_heads": args.kv_heads,
        "head_dim": 64,
        "vocab": tok.get_vocab_size(),
        "train_docs": args.train_docs,
        "train_tokens": num_train_tokens,
        "tokens_seen": tokens_seen,
        "steps": step,
        "train_s": round(train_s, 1),
        "total_s": round(time.perf_counter() - t_start, 1),
        "final_train_loss": round(log[-1]["loss"], 4) if log else None,
        "final_train_ppl": round(math.exp(log[-1]["loss"]), 3) if log else None,
        **eval_result,
    }
    (out / "train_log.json").write_text(json.dumps({"summary": summary, "log": log}, indent=1) + "\n")
    print(json.dumps(summary))
    return 0


# the part of each answer that only an earlier fact gives (not the words the question repeats)
_ANSWER_VALUES = (
    re.compile(r"answer : \w+ lives in ([^.]+) \."),
    re.compile(r"what color does \w+ like \? answer : (\w+) \."),
    re.compile(r"how many \w+ does \w+ have \? answer : (\w+) \w+ \."),
    re.compile(r"who is the friend of \w+ \? answer : (\w+) \."),
)


def answer_accuracy(model, tok, docs: list[str], max_len: int = 2048) -> dict:
    """Teacher-forced: the fraction of answers (home, colour, count, friend) inside the first
    `max_len` tokens of each eval document whose every token is the model's argmax. Guessing
    without the context gets about 1 in 12."""
    import torch

    bos = tok.token_to_id("<s>")
    correct = total = 0
    for doc in docs:
        enc = tok.encode(doc, add_special_tokens=False)
        ids, offsets = [bos] + enc.ids[:max_len], [(0, 0)] + enc.offsets[:max_len]
        with torch.no_grad():
            pred = model(input_ids=torch.tensor([ids[:-1]])).logits[0].argmax(-1).tolist()
        spans = [(m.start(1) - 1, m.end(1)) for rx in _ANSWER_VALUES for m in rx.finditer(doc)]  # with its space
        for start, end in spans:
            rows = [i for i in range(1, len(ids)) if start <= offsets[i][0] and offsets[i][1] <= end]
            if not rows or (rows[-1] == len(ids) - 1 and offsets[-1][1] < end):
                continue  # outside the window (or cut by it)
            total += 1
            correct += all(pred[i - 1] == ids[i] for i in rows)
    return {"answer_accuracy": round(correct / total, 4) if total else None, "answers_scored": total}


def parity_check(out: Path, num_prompts: int = 3, prompt_tokens: int = 300, max_tokens: int = 32) -> dict:
    """kvtier (`LLM`, float32) and transformers greedy-decode the same eval prompts; the token ids
    must be identical."""
    import torch
    from transformers import LlamaForCausalLM

    from kvtier import LLM, SamplingParams

    llm = LLM(str(out), dtype="float32", num_device_blocks=256, block_size=16)
    text = (out / "eval.txt").read_text().split("\n\n")
    prompts = [llm.tokenizer.encode(doc)[:prompt_tokens] for doc in text[:num_prompts]]
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    hf = LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    theirs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(max_tokens):  # plain greedy, no cache, eos not special (as ignore_eos)
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
            theirs.append(ids[len(prompt) :])
    return {
        "parity_prompts": len(prompts),
        "parity_tokens": sum(map(len, ours)),
        "parity_greedy_identical": ours == theirs,
        "sample_completion": llm.tokenizer.decode(ours[0]),
    }


def evaluate(model, eval_ids: list[list[int]], lengths: tuple[int, ...]) -> dict:
    """Held-out loss (mean next-token NLL) over the first L + 1 tokens of each eval document, for
    each L: falling with L means the model uses its longer context."""
    import torch

    out: dict = {}
    with torch.no_grad():
        for length in lengths:
            docs = [d[: length + 1] for d in eval_ids if len(d) > length]
            if not docs:
                continue
            x = torch.tensor(docs, dtype=torch.long)
            logits = model(input_ids=x[:, :-1]).logits
            nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
            out[f"eval_loss_{length}"] = round(nll.item(), 4)
            out[f"eval_ppl_{length}"] = round(math.exp(nll.item()), 3)
    return out


if __name__ == "__main__":
    sys.exit(main())
