"""Two lm-eval tasks built from held-out text, for measuring a converted model against its original without the Hub:

- ``normswap_lastword``, in the manner of LAMBADA (``lambada_openai``'s templates): a passage that ends a sentence,
  its last word to predict from the rest (log-likelihood, greedy-match accuracy and perplexity of the word);
- ``normswap_continuation``, in the manner of HellaSwag: the first sentences of a passage and four endings, its own
  last sentence and the last sentences of three other passages (accuracy, length-normalized accuracy).

Passages are runs of whole sentences of prose paragraphs (headings and code skipped), from every text given; the
examples are shuffled with a fixed seed, so ``--limit N`` reads a mix of the texts. The data and the task YAMLs are
written to a folder outside the repository (the text is not the repository's to ship):

    python scripts/evaluation/build_local_tasks.py /work/shared/data/wikitext-2/wiki.test.raw builtin:evaluation \\
        --output /work/bench/local-tasks
    normswap eval MODEL --against ORIGINAL --tasks /work/bench/local-tasks --limit 500
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

from hf_normswap.data import load_texts  # internal: each text read as normswap reads --data

ROOT = Path(__file__).resolve().parents[2]
MIN_WORDS, MAX_WORDS = 30, 120  # a passage's length
MIN_CONTEXT, ENDING_WORDS = 15, (6, 40)  # the continuation task's context and ending lengths
CHOICES = 4
APART = 50  # passages between an example and its distractors' sources: other articles, not the next paragraph
LASTWORD = """task: normswap_lastword
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: loglikelihood
test_split: test
doc_to_text: "{{{{text.split(' ')[:-1]|join(' ')}}}}"
doc_to_target: "{{{{' '+text.split(' ')[-1]}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
CONTINUATION = """task: normswap_continuation
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: multiple_choice
test_split: test
doc_to_text: "{{{{query}}}}"
doc_to_target: "{{{{label}}}}"
doc_to_choice: "{{{{choices}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""


def _prose(paragraph: str) -> bool:
    words = paragraph.split()
    return (len(words) >= MIN_WORDS and not paragraph.lstrip().startswith("=")
            and sum(w.isalpha() for w in words) >= 0.7 * len(words))


def passages(text: str) -> list[list[str]]:
    """Runs of whole sentences, MIN_WORDS to MAX_WORDS words, from the prose paragraphs of ``text``."""
    found = []
    for paragraph in re.split(r"\n\s*\n|\n(?= = )|\n ", text):
        paragraph = " ".join(paragraph.split())
        if not _prose(paragraph):
            continue
        run = []
        for sentence in re.split(r"(?<=[.!?])\s+", paragraph):
            run.append(sentence)
            if len(" ".join(run).split()) >= MIN_WORDS:
                if len(" ".join(run).split()) <= MAX_WORDS:
                    found.append(run)
                run = []
    return found


def lastword_example(run: list[str]) -> dict | None:
    """The passage without its final punctuation, when it ends in a word (LAMBADA's ``text``)."""
    text = re.sub(r"\s*[.!?]+$", "", " ".join(run))
    last = text.split(" ")[-1]
    return {"text": text} if last.isalpha() and len(last) > 1 else None


def continuation_examples(runs: list[list[str]], rng: random.Random) -> list[dict]:
    """Context: all but a passage's last sentence; choices: that sentence and the last ones of three passages at
    least APART passages away (of other documents, mostly)."""
    usable = [r for r in runs if len(r) > 1 and len(" ".join(r[:-1]).split()) >= MIN_CONTEXT
              and ENDING_WORDS[0] <= len(r[-1].split()) <= ENDING_WORDS[1]]
    endings = [r[-1] for r in usable]
    examples = []
    for i, run in enumerate(usable):
        others = rng.sample([e for j, e in enumerate(endings) if abs(j - i) > APART and e != run[-1]], CHOICES - 1)
        label = rng.randrange(CHOICES)
        examples.append({"query": " ".join(run[:-1]), "choices": others[:label] + [run[-1]] + others[label:],
                         "label": label})
    return examples


def _write(folder: Path, name: str, rows: list[dict], template: str) -> None:
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / f"{name}.yaml").write_text(template.format(data=data.resolve()))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("texts", nargs="+", help="held-out text: local files or a data spec (builtin:evaluation)")
    parser.add_argument("--output", required=True, help="folder for the data and the task YAMLs")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    output = Path(args.output).expanduser().resolve()
    if output == ROOT or ROOT in output.parents:
        print(f"build_local_tasks: error: --output {output} is inside the repository; the tasks hold text it must "
              "not ship: write them elsewhere", file=sys.stderr)
        return 2
    runs = [run for spec in args.texts for text in load_texts(spec, "evaluation") for run in passages(text)]
    rng = random.Random(args.seed)
    lastword = [e for e in map(lastword_example, runs) if e is not None]
    continuation = continuation_examples(runs, rng)
    rng.shuffle(lastword)
    rng.shuffle(continuation)
    output.mkdir(parents=True, exist_ok=True)
    _write(output, "normswap_lastword", lastword, LASTWORD)
    _write(output, "normswap_continuation", continuation, CONTINUATION)
    print(json.dumps({"output": str(output), "passages": len(runs), "normswap_lastword": len(lastword),
                      "normswap_continuation": len(continuation), "texts": args.texts}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
