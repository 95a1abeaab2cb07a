"""Mixture-of-experts models: which parameters are routed experts, and how many of them one token runs through.

A token of a mixture of experts runs through its router's choice of ``k`` of the ``E`` experts of each sparse layer,
and through everything else: the attention, the router itself, shared experts, the layers that stay dense. A step's
forward and backward FLOPs follow those *active* parameters (``ModelShapes.active_parameters``); everything that is
held or updated follows all of them: the weights, the gradients and the optimizer's state on the device and on the
host, the optimizer's step, the gradients' all-reduce. Pricing the compute of every expert makes a 30 B model with
3 B active parameters look ten times slower than it is, and so the host's step look hidden behind compute that never
happens.

Transformers 5 builds the routed experts of a sparse layer as one module named ``experts`` whose parameters are fused
along a first dimension of the experts: Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral and DeepSeek-V3 hold ``[experts, out,
in]``, GPT-OSS ``[experts, in, out]`` and its biases ``[experts, out]``. The count needs only that first dimension,
and it is checked against the config's expert count, never assumed. Which layers are sparse is read from the model
transformers builds, not from the config's keys, so ``mlp_only_layers`` and ``decoder_sparse_step`` (Qwen-MoE) and
``first_k_dense_replace`` (DeepSeek) come out as transformers applies them; shared experts (``shared_expert``,
``shared_experts``) and the routers are dense parameters that every token runs through.

Each architecture's rule (:data:`EXPERT_RULES`) names its config keys; an architecture that routes tokens and has no
rule, or whose experts transformers builds in another layout, is refused where its FLOPs are needed, with the fix.
There is no expert parallelism: data parallel replicates every expert, FSDP2 shards every expert's rows across the
ranks like any other parameter.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torch import nn

from lightning_zenflow.planner.sizes import PlanError

EXPERTS_MODULE = "experts"
"""The name transformers gives the module that holds a sparse layer's routed experts."""
ROUTING_KEYS = (
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "moe_num_experts",
    "num_experts_per_tok",
    "experts_per_token",
    "moe_topk",
)
"""Config keys that say a model routes tokens to experts (any of them above zero), whether or not it has a rule."""
RULES_HOME = "EXPERT_RULES in lightning_zenflow/planner/experts.py"


@dataclass(frozen=True)
class ExpertRule:
    """How one architecture's config names its routing (the model's structure says the rest)."""

    experts_key: str
    """The config key of the routed experts in each sparse layer."""
    per_token_key: str = "num_experts_per_tok"
    """The config key of the experts each token runs through."""
    modules: tuple[str, ...] = (EXPERTS_MODULE,)
    """The names of the modules whose parameters are the routed experts, fused ``[experts, ...]``."""


EXPERT_RULES = {
    "qwen3_moe": ExpertRule("num_experts"),
    "qwen2_moe": ExpertRule("num_experts"),
    "olmoe": ExpertRule("num_experts"),
    "mixtral": ExpertRule("num_local_experts"),
    "gpt_oss": ExpertRule("num_local_experts"),
    "deepseek_v3": ExpertRule("n_routed_experts"),
}
"""The mixtures of experts the planner counts, by ``model_type``: each was built from a small config on the meta device
and its ``experts`` modules checked against this rule (``tests/test_plan_moe.py``)."""


@dataclass(frozen=True)
class Routing:
    """Which parameters one token runs through: every one (a dense model), or of a mixture of experts the ``per_token``
    of the ``experts`` fused along the first dimension of each parameter in :attr:`routed`."""

    experts: int = 0
    per_token: int = 0
    routed: frozenset[str] = frozenset()
    """The routed experts' parameters, by name (each ``[experts, ...]``)."""
    unknown: str | None = None
    """Why the parameters a token runs through cannot be counted, and the fix (None: they can)."""

    @property
    def mixture(self) -> bool:
        """Whether the model routes tokens to experts (its routing known or not)."""
        return bool(self.routed) or self.unknown is not None

    def describe(self) -> str:
        """``"8 of 128 experts per token"``, or an empty string for a dense model or an unknown routing."""
        return f"{self.per_token} of {self.experts} experts per token" if self.routed else ""


def expert_modules(model: nn.Module, names: tuple[str, ...] = (EXPERTS_MODULE,)) -> Iterator[tuple[str, nn.Module]]:
    """The modules that hold a sparse layer's routed experts (those called one of ``names``), with their names in
    ``model``."""
    for name, module in model.named_modules():
        if name.rpartition(".")[2] in names:
            yield name, module


def routing_of(model: nn.Module, config: Any, source: str) -> Routing:
    """The routing of ``model`` (its Hugging Face ``config``, or None for a module without one); ``source``: what the
    user passed as ``--model``, for the messages."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = getattr(text, "model_type", None)
    rule = EXPERT_RULES.get(model_type)
    if rule is None:
        if any(True for _ in expert_modules(model)) or _routes_tokens(text):
            return Routing(unknown=_no_rule(source, model_type, config))
        return Routing()
    experts, per_token = _counts(text, rule, source)
    routed = []
    for prefix, module in expert_modules(model, rule.modules):
        params = list(module.named_parameters())
        layout = {tuple(p.shape) for _, p in params if p.ndim == 0 or p.shape[0] != experts}
        if not params or layout:
            shapes = ", ".join(str(list(s)) for s in sorted(layout)) or "no parameters"
            return Routing(unknown=_other_layout(source, model_type, prefix, experts, shapes))
        routed += [f"{prefix}.{name}" for name, _ in params]
    if not routed:
        return Routing()  # every layer dense (num_experts 0, every layer in mlp_only_layers)
    return Routing(experts, per_token, frozenset(routed))


def _counts(text: Any, rule: ExpertRule, source: str) -> tuple[int, int]:
    experts = getattr(text, rule.experts_key, None)
    per_token = getattr(text, rule.per_token_key, None)
    for key, value in ((rule.experts_key, experts), (rule.per_token_key, per_token)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise PlanError(f"--model {source!r}: its config's {key} is {value!r}; a whole number is needed.")
    if experts and not 1 <= per_token <= experts:
        raise PlanError(
            f"--model {source!r}: its config routes each token to {rule.per_token_key}={per_token} of "
            f"{rule.experts_key}={experts} experts; it must be between 1 and {experts}."
        )
    return experts, per_token


def _routes_tokens(text: Any) -> bool:
    for key in ROUTING_KEYS:
        value = getattr(text, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return True
    return False


def _no_rule(source: str, model_type: str | None, config: Any) -> str:
    architectures = ", ".join(getattr(config, "architectures", None) or [])
    what = f"{model_type or 'this model'}{f' ({architectures})' if architectures else ''}"
    return (
        f"--model {source!r}: {what} routes each token through some of its experts, and the planner has no rule for "
        "which ones, so it cannot count the FLOPs of a step. Pass the forward and backward of one step as measured "
        f"with --fwd-bwd-s SECONDS (fwd_bwd_s= in Python), or add the architecture to {RULES_HOME} (the config keys "
        "of its expert count and of its experts per token, and the modules that hold its routed experts)."
    )


def _other_layout(source: str, model_type: str, prefix: str, experts: int, shapes: str) -> str:
    import transformers

    return (
        f"--model {source!r}: transformers {transformers.__version__} builds {prefix} of {model_type} with "
        f"parameters {shapes}, not fused along a first dimension of its {experts} experts as the planner's rule "
        "expects (transformers 5's layout), so it cannot count the experts a token runs through. Install "
        "transformers 5 (pip install 'transformers>=5'), pass the forward and backward of one step as measured "
        f"with --fwd-bwd-s SECONDS, or change the rule in {RULES_HOME}."
    )
