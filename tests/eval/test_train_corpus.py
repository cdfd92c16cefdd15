"""The generated training language of benchmarks/train_small_model.py needs its context: every
answer is a fact stated earlier in the same document, every recall repeats an earlier span.
(No training here: only the text generator, which is pure Python.)"""

from __future__ import annotations

import importlib.util
import random
import re
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "train_small_model.py"


def load_script():
    spec = importlib.util.spec_from_file_location("train_small_model", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_answers_and_recalls_refer_to_earlier_context():
    gen = load_script()
    doc = gen.generate_document(random.Random(3), 1500)
    sentences = re.findall(r"[^.?]+[.?](?: answer :[^.]+\.)?", doc)
    assert len(doc.split()) >= 1500
    num_questions = num_recalls = 0
    for s in sentences:
        before = doc[: doc.index(s)] if s in doc else ""
        s = s.strip()
        m = re.match(r"question : where does (\w+) live \? answer : \1 lives in ([\w' ]+) \.", s)
        if m:
            num_questions += 1
            assert f"{m.group(1)} lives in {m.group(2)} ." in before
        m = re.match(r"question : who is the friend of (\w+) \? answer : (\w+) \.", s)
        if m:
            num_questions += 1
            assert f"{m.group(1)} is a friend of {m.group(2)} ." in before
        if s.startswith("recall : "):
            num_recalls += 1
            assert s.removeprefix("recall : ") in before
    assert num_questions > 5 and num_recalls > 5


def test_corpus_is_deterministic_per_seed():
    gen = load_script()
    a = gen.generate_corpus(5, 3, (100, 200))
    assert a == gen.generate_corpus(5, 3, (100, 200))
    assert a != gen.generate_corpus(6, 3, (100, 200))
