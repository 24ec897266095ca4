"""README.md for a converted checkpoint: what was done to which model, how to load it, what to cite.

Metadata (``base_model``, ``library_name``, tags) goes through ``huggingface_hub.ModelCardData`` so the Hub reads it.
Everything shown comes from the saved ``config.json``: the card cannot disagree with the checkpoint.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import yaml
from huggingface_hub import ModelCard, ModelCardData, metadata_load

from ..modules import METHODS
from . import remote_code
from .packaged import PACKAGED
from .record import ConversionRecord

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
TAG = "hf-normswap"  # in every card's metadata: marks a README.md as this package's to rewrite

def hub_id(name_or_path: str | None) -> str | None:
    """The Hub id a model was loaded from, when it was a Hub id (or a packaged model), else None."""
    if not name_or_path:
        return None
    for key, (_, module, _, hub) in PACKAGED.items():
        if module in Path(name_or_path).parts or name_or_path == f"offline:{key}":
            return hub
    if HUB_ID.match(name_or_path) and not Path(name_or_path).exists():
        return name_or_path
    return None


def _number(value) -> str:
    if isinstance(value, (list, tuple)):
        return ", ".join(_number(v) for v in value)
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _calibration_section(calibration) -> str:
    if not calibration:
        return ("No calibration data: the shape parameters come from the analytic initialization (the source norm's "
                "slope at zero for inputs of the scale measured on random token ids, or of the given input scale), "
                "so the converted model approximates the original only roughly.")
    if not isinstance(calibration, dict):
        return f"`{calibration}`"
    rows = ["| setting | value |", "|---|---|"]
    for key, value in calibration.items():
        shown = ", ".join(f"{k}={_number(v)}" for k, v in value.items()) if isinstance(value, dict) else _number(value)
        rows.append(f"| {key} | {shown} |")
    return "\n".join(rows)


def _recorded_terms(distill: dict) -> list[str]:
    """A record written before the loss's terms described themselves (``training.loss``): its terms in words from
    the ``distill`` settings."""
    terms = []
    if distill.get("logits", True):
        terms.append(f"KL divergence to the original's logits (temperature {_number(distill.get('temperature', 1.0))})")
    if distill.get("hidden"):
        terms.append(f"every block's output toward the original's (weight {_number(distill['hidden'])})")
    if distill.get("embedding"):
        terms.append(f"1 - cosine of the pooled embedding to the original's (weight {_number(distill['embedding'])})")
    if distill.get("scale"):
        where = "every converted norm's" if distill.get("scale_at") == "all" else "the final norm's"
        terms.append(f"the spread of {where} input scale across tokens (weight {_number(distill['scale'])})")
    return terms


def _loss(distill: dict, terms: list[str] | None) -> str:
    """The recipe's loss in words: ``(1 - weight) * CE + weight * distillation``, the distillation's ``terms`` as
    they describe themselves (``training.recovery_loss``)."""
    distillation = " plus ".join(_recorded_terms(distill) if terms is None else terms)
    weight = distill.get("weight") or 0
    if not weight or not distillation:
        return "causal-LM cross-entropy"
    if weight == 1:
        return f"distillation from the original alone, {distillation}"
    return f"causal-LM cross-entropy ({_number(1 - weight)}) and distillation ({_number(weight)}), {distillation}"


def _training_section(training) -> str | None:
    """Fine-tuning after calibration (recipes/finetune.py records this block), or None when there was none."""
    if not training:
        return None
    loss = _loss(training.get("distill") or {}, training.get("loss"))
    data = training.get("train_data")
    data = " + ".join(map(str, data)) if isinstance(data, list) else data  # a mix of sources
    lines = [f"Fine-tuned after calibration with `recipes/finetune.py` (transformers `Trainer`): {loss}; trained "
             f"parameters: `{training.get('trainable')}`; {training.get('steps')} steps, "
             f"{training.get('tokens_seen')} tokens of `{data}` in "
             f"{training.get('wall_seconds')} s on {training.get('world_size', 1)} process(es)."]
    if training.get("hand_over"):  # its kind's own sentence (training.hand_overs)
        lines.append(training["hand_over"])
    elif training.get("progressive"):  # a record written before hand-overs described themselves
        lines.append("The norms were handed over from the original to the converted modules progressively "
                     f"({training['progressive'].get('order')} order).")
    elif training.get("taper"):
        taper = training["taper"]
        length = (f"its first {taper['steps']} steps" if taper.get("steps") else
                  f"the first {taper.get('fraction'):g} of the steps")
        lines.append("Each converted module was blended with its original norm, `g * norm(x) + (1 - g) * new(x)`, "
                     f"`g` falling from 1 to 0 ({taper.get('schedule')}) over {length}; the saved model has no norm.")
    return " ".join(lines)


def hand_over_warning(hand_over) -> str | None:
    """What a checkpoint saved mid hand-over is (a Trainer checkpoint of a tapered or progressive run), or None: the
    card, ``load`` and ``push`` say it."""
    if not hand_over:
        return None
    fraction = hand_over.get("converted_fraction")
    fraction = f"{fraction:.3g}" if isinstance(fraction, (int, float)) else "?"
    return (f"saved at step {hand_over.get('step')} of a {hand_over.get('schedule')} hand-over, which blends the "
            f"converted modules with the original's norms until step {hand_over.get('ends_at_step')} (converted "
            f"fraction {fraction}): without those norms it is not the model that was training; resume the run to "
            "its end, or use its final checkpoint")


def _mid_hand_over(hand_over) -> str:
    warning = hand_over_warning(hand_over)
    return f"\n**Mid hand-over**: this checkpoint was {warning}.\n" if warning else ""


def _evaluation_section(evaluation) -> str | None:
    if not evaluation:
        return None
    metrics = evaluation.get("metrics", {k: v for k, v in evaluation.items() if isinstance(v, dict)})
    lines = []
    if evaluation.get("dataset"):
        lines.append(f"Measured on {evaluation['dataset']}" + (
            f" ({evaluation['tokens']} tokens)." if evaluation.get("tokens") else "."))
        lines.append("")
    lines += ["| metric | original | converted | ratio |", "|---|---|---|---|"]
    for name, values in metrics.items():
        original, converted = values.get("original"), values.get("converted")
        ratio = f"{converted / original:.4g}" if isinstance(original, (int, float)) and isinstance(
            converted, (int, float)) and original else ""
        lines.append(f"| {name} | {_number(original)} | {_number(converted)} | {ratio} |")
    if evaluation.get("fit_for_use"):  # the recipe's final_eval tails and tasks (``evaluation.fit_for_use``)
        lines += ["", "Fit for use, on the same text and task examples:", "", evaluation["fit_for_use"]]
    return "\n".join(lines)


def _check_section(check) -> str | None:
    """The check run after the conversion (``evaluation.conversion_check``), in one sentence."""
    if not check:
        return None
    if check.get("metric") == "perplexity":
        found = (f"perplexity {_number(check.get('original'))} -> {_number(check.get('converted'))}, "
                 f"{_number(check.get('value'))}x the original's")
    else:
        found = f"output cosine to the original {_number(check.get('value'))}"
    verdict = "**failed**: far from the original" if check.get("failed") else "passed"
    return f"Checked after the conversion on {check.get('data')}: {found}; {verdict}."


def is_own_card(path: Path) -> bool:
    """Whether a README.md is a card this package wrote (its metadata tags name the package), not the user's."""
    try:
        metadata = metadata_load(path) or {}
    except (yaml.YAMLError, ValueError):  # malformed metadata or text: not a card we wrote
        return False
    return TAG in (metadata.get("tags") or [])


def _auto_class(config: dict) -> str:
    """The Auto class the loading snippet names, so the example loads the model with its head."""
    auto_classes = sorted(k for k in config.get("auto_map", {}) if k != "AutoConfig") or ["AutoModel"]
    return "AutoModelForCausalLM" if "AutoModelForCausalLM" in auto_classes else auto_classes[0]


def _converted_tables(converted) -> tuple[str, str]:
    """The per-kind count rows and the per-module list, so the card shows what was converted."""
    kinds = Counter((e.kind, e.role or "?") for e in converted.values())
    kind_rows = "\n".join(f"| {kind} | {role} | {n} |" for (kind, role), n in sorted(kinds.items()))
    names = "\n".join(f"- `{name}` ({e.kind}, C={e.size}, amplitude={e.amplitude:.4g})"
                      for name, e in converted.items())
    return kind_rows, names


def _description(record, method_class, origin: str, version, kind_rows: str, names: str) -> str:
    """The title, method, conversion and calibration sections, which every card has."""
    method = record.method
    converted = record.converted
    return f"""
# {record.base.architecture} with {method.upper()} instead of LayerNorm / RMSNorm

This checkpoint is {origin} with {len(converted)} normalization layers replaced by element-wise
**{method_class.title}** modules, made with [hf-normswap](https://pypi.org/project/hf-normswap/) {version}.
{_mid_hand_over(record.hand_over)}
## Method

Each converted norm computes, {"per element and without any statistics over the channels" if
method_class.saturates else "with one fixed scale per module instead of each token's own"},

```
{method_class.formula}
```

where {method_class.shape_note}, and `weight` is the source norm's learned scale times the amplitude
(`sqrt(C-1)` for LayerNorm, `sqrt(C)` for RMSNorm, `C` the channel count; 1 for `linear`). Shape parameters are computed in fp32.
ELN is the exact solution of LayerNorm's differential equation once its channel-dependent term becomes one learnable
constant; DyT additionally assumes a constant standard deviation.

## What was converted

Method `{method}`, per-channel shape parameter: `{record.per_channel}`.

| source kind | role | count |
|---|---|---|
{kind_rows}

<details><summary>All {len(converted)} converted modules</summary>

{names}

</details>

## Calibration

{_calibration_section(record.calibration)}
"""


def _optional_sections(record, evaluation: str | None) -> str:
    """The check, fine-tuning and evaluation sections, each only when the record has it."""
    body = ""
    check = _check_section(record.check)
    if check:
        body += f"""
## Check after the conversion

{check}
"""
    training = _training_section(record.training)
    if training:
        body += f"""
## Fine-tuning

{training}
"""
    if evaluation:
        body += f"""
## Evaluation against the original

{evaluation}
"""
    return body


def _usage(config: dict, record, method_class, auto: str, citations: list) -> str:
    """The loading and citation sections, so a reader can load the checkpoint safely and cite the method."""
    return f"""
## How to load

With remote code (only `torch` and `transformers` needed; the code is in `modeling_normswap.py`):

```python
from transformers import {auto}, AutoTokenizer
model = {auto}.from_pretrained("REPO_OR_PATH", trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained("REPO_OR_PATH", trust_remote_code=True)  # when the model has one
```

With the package (`pip install hf-normswap`), without running remote code:

```python
import hf_normswap
model = hf_normswap.load("REPO_OR_PATH")
from hf_normswap.checkpoint.loading import load_model
model, tokenizer = load_model("REPO_OR_PATH")  # with the tokenizer
```

Without `trust_remote_code=True` the stock loaders refuse this checkpoint (its `model_type` is
`{config["model_type"]}`): the original `{record.base.architecture}` class would drop the
`{method_class.shape_name}` parameters. The package's loader also checks the `normswap` record against the
weights (its format version, each module's method, the norms converted) and refuses a checkpoint edited since it
was saved; the remote code builds what the record says without those checks.

## Citation

```bibtex
{chr(10).join(citations)}
```
"""


def render(config: dict) -> str:
    """The model card text (YAML metadata + Markdown) for a saved ``config.json``."""
    record = ConversionRecord.in_config(config)
    method_class = METHODS[record.method]
    base_model = record.base_model
    auto = _auto_class(config)
    data = ModelCardData(
        base_model=base_model,
        library_name="transformers",
        tags=[TAG, record.method, "normalization-free", record.base.model_type, "custom_code"],
    )
    kind_rows, names = _converted_tables(record.converted)
    origin = f"[{base_model}](https://huggingface.co/{base_model})" if base_model else "a local model"
    evaluation = _evaluation_section(record.evaluation)
    citations = [METHODS[key].citation for key in method_class.builds_on] + [method_class.citation]
    version = (record.package or {}).get("version", record.version)

    body = _description(record, method_class, origin, version, kind_rows, names)
    body += _optional_sections(record, evaluation)
    body += _usage(config, record, method_class, auto, citations)
    return ModelCard(f"---\n{data.to_yaml()}\n---\n{body}").content


def render_stock(config: dict) -> str:
    """The card of a stock export (``stock_export.py``): the original architecture, no remote code."""
    record = ConversionRecord.in_config(config)
    base, stock = record.base, record.stock
    auto = next((name for name in ("AutoModelForCausalLM", "AutoModelForMaskedLM")
                 if name in remote_code.auto_classes(base.architecture, base.model_type)), "AutoModel")
    data = ModelCardData(base_model=record.base_model, library_name="transformers",
                         tags=[TAG, "linear", "normalization-free", base.model_type])
    origin = (f"[{record.base_model}](https://huggingface.co/{record.base_model})" if record.base_model
              else "a local model")
    keys = ", ".join(f"`{key}`" for key in stock["eps_keys"])
    body = f"""
# {base.architecture} without normalization (stock architecture)

This checkpoint is {origin} with its {len(record.converted)} normalization layers replaced by fixed linear maps
(`linear`, FakeLN: `y = weight * alpha * x + bias`, centred for a LayerNorm), made with
[hf-normswap](https://pypi.org/project/hf-normswap/). It is saved as the stock `{base.architecture}`: each norm keeps
its class with epsilon {stock["eps"]:.0e} ({keys}), so large that the per-token statistic is lost in it and the norm
is the fixed scale its weight carries. Keep the config's epsilon as it is: it is part of the weights.

## How to load

No remote code and no package needed:

```python
from transformers import {auto}
model = {auto}.from_pretrained("REPO_OR_PATH")
```

Any tool that reads the stock architecture reads it. Compute in fp32 or bf16, not fp16: the norms' weights are
about `1 / sqrt(epsilon)` times the original's. `hf_normswap.load("REPO_OR_PATH")` rebuilds the `linear` modules
from the `normswap` record in `config.json`, which transformers leaves unused.

## Training

{_training_section(record.training) or "Not fine-tuned after the conversion."}

## Citation

```bibtex
{METHODS["linear"].citation}
```
"""
    return ModelCard(f"---\n{data.to_yaml()}\n---\n{body}").content
