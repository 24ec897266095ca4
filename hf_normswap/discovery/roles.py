"""Label each norm with its role in the network, from how data flows through two forward passes (whatever the
number of norms).

Roles: ``attention_input`` / ``mlp_input`` (pre-norm: the norm's output feeds that sublayer), ``post_norm``
(the norm's output is the residual stream itself, BERT-style, or is added to it, Gemma2-style sandwich),
``embedding`` and ``final`` (outside the repeated blocks, before or after them), ``qk_norm`` (over head_dim),
``other``. Two behavioural tests replace a hand-kept name table, which differs per architecture and drifts:
which module first consumes the norm's output, and whether zeroing the norm cuts the block's input off from its
output (true only when the norm sits on the residual path).
"""

from __future__ import annotations

import re
from contextlib import contextmanager

import torch
from torch import nn

from ..model_inputs import StopForward, dummy_inputs, first_tensor, text_config
from .norms import NormInfo

ROLES = ("attention_input", "mlp_input", "post_norm", "embedding", "final", "qk_norm", "other")
ATTENTION = re.compile(r"attn|attention|query_key_value|qkv|q_proj|mixer", re.IGNORECASE)
MLP = re.compile(r"mlp|ffn|feed_?forward|intermediate|moe|expert|fc1|c_fc|dense_h_to_4h|DenseReluDense", re.IGNORECASE)
QK_NAME = re.compile(r"(^|[._])(q|k|query|key)_?(norm|layernorm|ln)$", re.IGNORECASE)
BLOCK = re.compile(r"^(.*?\.\d+)(\.|$)")  # outermost ModuleList element: the repeated block


def block_of(name: str) -> str | None:
    match = BLOCK.match(name)
    return match.group(1) if match else None


def _head_dim(config) -> int | None:
    head_dim = getattr(config, "head_dim", None)
    heads = getattr(config, "num_attention_heads", None)
    hidden = getattr(config, "hidden_size", None)
    return head_dim or (hidden // heads if hidden and heads else None)


def _tensor_ptrs(values) -> set[int]:
    ptrs = set()
    for v in values:
        if isinstance(v, torch.Tensor):
            ptrs.add(v.data_ptr())
        elif isinstance(v, (tuple, list)):
            ptrs |= _tensor_ptrs(v)
    return ptrs


@contextmanager
def _hooks(handles: list):
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _trace(model: nn.Module, norms: list[NormInfo], inputs: dict) -> tuple[list[str], dict[str, str | None]]:
    """One forward pass: module call order, and the first module consuming each norm's output."""
    order: list[str] = []
    outputs: dict[str, torch.Tensor] = {}  # kept alive so their memory addresses are not reused
    consumer: dict[str, str | None] = {n.name: None for n in norms}
    norm_names = set(consumer)
    handles = []

    def pre_hook(name):
        def hook(module, args, kwargs):
            order.append(name)
            ptrs = _tensor_ptrs(args) | _tensor_ptrs(kwargs.values())
            for norm, out in outputs.items():
                if consumer[norm] is None and out.data_ptr() in ptrs and not norm.startswith(name + ".") and norm != name:
                    consumer[norm] = name

        return hook

    def post_hook(name):
        def hook(module, args, output):
            if isinstance(output, torch.Tensor):
                outputs[name] = output

        return hook

    for name, module in model.named_modules():
        if name:
            handles.append(module.register_forward_pre_hook(pre_hook(name), with_kwargs=True))
        if name in norm_names:
            handles.append(module.register_forward_hook(post_hook(name)))
    with _hooks(handles), torch.no_grad():
        model(**inputs)
    return order, consumer


def _residual_norms(model: nn.Module, norms: list[NormInfo], inputs: dict) -> set[str]:
    """Names of the norms that sit on the residual path, all tested in one batched forward pass.

    The batch holds two copies of the input per norm; in both, that norm's output is zeroed, and the second copy also
    gets noise added to the input of the norm's block. A norm is on the residual path when the block's outputs for
    the two copies still agree: zeroing it cut the block's input off from its output. Batch rows do not interact, so
    one pass answers for every norm, whatever their number (hidden states are batch-first in every supported model).
    """
    rows = 2 * len(norms)
    pair = {norm.name: slice(2 * i, 2 * i + 2) for i, norm in enumerate(norms)}
    noisy_rows: dict[str, list[int]] = {}
    for i, norm in enumerate(norms):
        noisy_rows.setdefault(block_of(norm.name), []).append(2 * i + 1)
    batch = {k: v.repeat(rows, *[1] * (v.dim() - 1)) for k, v in inputs.items()}
    outputs: dict[str, torch.Tensor] = {}
    modules = dict(model.named_modules())

    def zero(rows_of_norm):
        def hook(module, args, output):
            output = output.clone()
            output[rows_of_norm] = 0
            return output

        return hook

    def perturb(noisy):
        def hook(module, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            noise = torch.zeros_like(x)
            noise[noisy] = torch.randn_like(x[noisy])
            if args:
                return (x + noise,) + tuple(args[1:]), kwargs
            kwargs["hidden_states"] = x + noise
            return args, kwargs

        return hook

    def capture(block):
        def hook(module, args, output):
            outputs.setdefault(block, first_tensor(output).detach().float())
            if len(outputs) == len(noisy_rows):
                raise StopForward  # every tested block has run: the rest of the model need not

        return hook

    handles = [modules[norm.name].register_forward_hook(zero(pair[norm.name])) for norm in norms]
    for block, noisy in noisy_rows.items():
        handles.append(modules[block].register_forward_pre_hook(perturb(noisy), with_kwargs=True))
        handles.append(modules[block].register_forward_hook(capture(block)))
    with _hooks(handles), torch.no_grad():
        try:
            model(**batch)
        except StopForward:
            pass
    residual = set()
    for norm in norms:
        clean, noisy = outputs[block_of(norm.name)][pair[norm.name]]
        if torch.allclose(clean, noisy, atol=1e-5, rtol=1e-4):
            residual.add(norm.name)
    return residual


def _consumer_role(name: str, module: nn.Module) -> str | None:
    label = f"{type(module).__name__} {name.rsplit('.', 1)[-1]}"
    if ATTENTION.search(label):
        return "attention_input"
    if MLP.search(label):
        return "mlp_input"
    return None


def assign_roles(model: nn.Module, norms: list[NormInfo]) -> None:
    """Set ``role`` on each norm in place. Without a forward pass (unknown input type) roles fall back to names."""
    config = text_config(model)
    hidden, head_dim = getattr(config, "hidden_size", None), _head_dim(config)
    token_norms = []
    for norm in norms:
        if QK_NAME.search(norm.name) or (norm.size != hidden and norm.size == head_dim):
            norm.role = "qk_norm"
        elif norm.size != hidden and hidden is not None:
            norm.role = "other"
        else:
            token_norms.append(norm)
    try:
        inputs = dummy_inputs(model, batch=1, seq_len=4)
        order, consumer = _trace(model, token_norms, inputs)
    except Exception:  # the model cannot be run on dummy inputs: label by name only
        for norm in token_norms:
            norm.role = "embedding" if "emb" in norm.name.lower() else ("final" if block_of(norm.name) is None else "other")
        return
    modules = dict(model.named_modules())
    first_call = {}
    for i, name in enumerate(order):
        first_call.setdefault(name, i)
    in_blocks = [n for n in token_norms if n.name in first_call and block_of(n.name) is not None]
    residual = _residual_norms(model, in_blocks, inputs) if in_blocks else set()
    for norm in token_norms:
        block = block_of(norm.name)
        if norm.name not in first_call:
            norm.role = "other"  # never ran on this input
        elif block is None:
            norm.role = _outside_role(norm.name, first_call)
        elif norm.name in residual:
            norm.role = "post_norm"
        elif consumer[norm.name] is None:
            norm.role = "post_norm"  # output only added to the residual stream (sandwich norm)
        else:
            norm.role = _consumer_role(consumer[norm.name], modules[consumer[norm.name]]) or "other"


def _outside_role(name: str, first_call: dict[str, int]) -> str:
    """A norm outside the blocks is an embedding norm if its stack's blocks run after it, else a final norm."""
    parts = name.split(".")
    for depth in range(len(parts) - 1, -1, -1):
        prefix = ".".join(parts[:depth])
        blocks = [i for n, i in first_call.items() if block_of(n) == n and (not prefix or n.startswith(prefix + "."))]
        if blocks:
            return "embedding" if first_call[name] < min(blocks) else "final"
    return "final"


LAYER = re.compile(r"\.(\d+)(\.|$)")


def layer_of(name: str) -> int | None:
    """The index of the repeated block a module sits in, or None outside the blocks (embedding, final norm)."""
    match = LAYER.search(name)
    return int(match.group(1)) if match else None
