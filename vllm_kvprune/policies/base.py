"""A KV-cache method as one object: its settings, its traits and its decisions.

Everything outside a policy's module reads these, never the policy's name: the config checks
its settings (`config.KVPolicyConfig.validated`), the CLI and the request checks derive from
them, the worker plans its requests with the planner of its `layout` and asks it the
decisions of that layout (which tokens survive, which are evicted), the model runner refuses
the model features it lists, the docs' tables are rendered from them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from vllm_kvprune.policies.settings import BUDGET, FDC, PRUNE_INTERVAL, SINKS, WINDOW, KVConfigError, Setting, Surface

if TYPE_CHECKING:
    from vllm_kvprune.config import KVPolicyConfig

NameOf = Callable[[str], str]  # a setting's field name -> how the surface at hand spells it

# What a request's map holds, and so which planner plans it (`worker/layouts/`):
LAYOUTS = {
    "tokens": "one slot map for every layer and head (EQUIP in-place slots)",
    "heads": "per layer and KV head its own tokens, every head the same count (EQUIP per head)",
    "blocks": "per layer its own block order (whole blocks evicted)",
    "head_pages": "per layer and KV head its own tokens and count, packed in head-pages",
    "full": "vLLM's own block tables: every token kept",
}


class Policy:
    """One KV-cache method.

    Settings: `settings` are the ones it reads (shared ones from `policies/settings.py`, its
    own declared in its module); a setting it does not read, given a value other than its
    default, is refused (`refused_settings[name]` says why where a reason is more useful than
    "does not apply"). `notes[name]` says what a shared setting means under this policy (help,
    docs).

    Traits: `layout` (a key of `LAYOUTS`), `fdc_refusal` (None where FDC's narrow heads compose
    with it, else why not), `gpu` (the GPU wrappers carry it out), `model_refusals` (model
    features it cannot honour, a `worker/features.py` feature name -> why), `eager` (why it
    needs eager mode, None if it does not), `reference` (its oracle's module under
    `vllm_kvprune.reference`, with a `from_config(model, config, block_size)`), `kvpress` (the
    press of NVIDIA's kvpress that keeps a prompt's tokens by the same or the nearest rule, for
    the benchmarks' side-by-side runs; its settings: `kvpress_settings`).

    Decisions: the methods its layout's planner calls (see each layout's planner).
    """

    name: ClassVar[str]
    summary: ClassVar[str]
    layout: ClassVar[str | None] = None
    settings: ClassVar[tuple[Setting, ...]] = ()
    notes: ClassVar[Mapping[str, str]] = {}
    refused_settings: ClassVar[Mapping[str, str]] = {}
    fdc_refusal: ClassVar[str | None] = "not built"
    gpu: ClassVar[bool] = True
    model_refusals: ClassVar[Mapping[str, str]] = {}
    eager: ClassVar[str | None] = None
    reference: ClassVar[str | None] = None
    kvpress: ClassVar[str | None] = None
    # head_pages: whether its prompt decision reads the statistics of each layer's query-projection
    # input over the prompt and projects synthetic states through the model (gvote's vote).
    gathers_hidden_states: ClassVar[bool] = False
    # heads, head_pages: whether the attention mass every query gives each token is kept (h2o).
    keeps_attention_mass: ClassVar[bool] = False

    def for_config(self, config: KVPolicyConfig) -> Policy:
        """The policy object that runs `config`: this one, or a variant of it a setting selects
        (another layout: `snapkv` with `allocation: pyramid` keeps head-pages). The config's
        `policy` is this."""
        return self

    # ---- traits derived from the declarations ----------------------------------------------
    def reads(self, setting_name: str) -> bool:
        return any(setting.name == setting_name for setting in self.settings)

    @property
    def budgeted(self) -> bool:
        """Whether a token budget bounds what a request keeps."""
        return self.reads(BUDGET.name)

    @property
    def reports_footprint(self) -> bool:
        """Whether the worker tells the scheduler what each request needs (no fixed cap)."""
        return self.layout == "head_pages"

    @property
    def per_layer_tables(self) -> bool:
        """Whether each layer's blocks are its own (one KV-cache group per layer, over the one
        pool): a request then holds the sum over layers of what each keeps, not its largest
        layer's need (docs/PER_LAYER.md). A policy whose layers keep different amounts."""
        return self.layout == "head_pages"

    @property
    def uncapped(self) -> bool:
        """Whether nothing bounds a request's blocks below `max_model_len`."""
        return self.layout in ("head_pages", "full")

    @property
    def composes_with_fdc(self) -> bool:
        return self.reads(FDC.name)

    # ---- validation ------------------------------------------------------------------------
    def validate(self, config: KVPolicyConfig, name_of: NameOf) -> KVPolicyConfig:
        """Checks across this policy's settings; returns the config with derived fields filled."""
        return config

    def check_engine(self, config: KVPolicyConfig, block_size: int, surface: Surface) -> None:
        """Checks that need the engine's block size."""

    def check_parallel(self, config: KVPolicyConfig, tensor_parallel_size: int, surface: Surface) -> None:
        """Checks that need the engine's tensor-parallel size."""

    def check_request(self, engine: KVPolicyConfig, request: KVPolicyConfig, name_of: NameOf) -> None:
        """A request's settings (`request`) against what the engine was started with (`engine`):
        what a request cannot change, refused naming the setting."""

    def merge_overrides(self, config: KVPolicyConfig, overrides: Mapping[str, Any]) -> Mapping[str, Any]:
        """Fields to reset when `overrides` replace some of `config`'s (a pair of settings that
        derive each other); validation then derives them again."""
        return {}

    # ---- capacity (the same pure functions on the scheduler and the worker) ------------------
    def cap_blocks(self, config: KVPolicyConfig, block_size: int) -> int:
        """Blocks a request keeps once its prompt is in."""
        raise NotImplementedError(f"policy {self.name!r} has no cap")

    def explain_capacity(self, config: KVPolicyConfig, block_size: int) -> str:
        """Why a request needs the blocks it does (admission's messages)."""
        return f"{self.name} keeps every token of a request's prompt and output, as without a policy"

    def kvpress_settings(self, config: KVPolicyConfig) -> dict[str, Any]:
        """The `kvpress` press's constructor settings that match `config` (the compression ratio
        aside), and its `name` where a setting selects another press than `kvpress`."""
        return {}

    def check_model(self, model: Any, layer_names: list[str]) -> str | None:
        """Why the loaded model cannot run this policy beyond its attention features (one line), or None."""
        return None

    def prompt_keep_mask(self, prompt: Any, config: KVPolicyConfig) -> np.ndarray:
        """`head_pages`: the prompt tokens each KV head of one layer keeps, bool `[H, P]`, once
        that layer has attended to the whole prompt; `prompt` is a
        `worker/layouts/head_pages.LayerPrompt` (the layer, its prompt queries of this step, its
        keys, and what a vote needs from the model)."""
        raise NotImplementedError(f"policy {self.name!r} has no prompt decision on head-pages")

    def prompt_tail(self, config: KVPolicyConfig) -> int:
        """Tokens at the end of a prompt that must be computed in one step (its last chunk):
        the scheduler never ends a prompt's chunk fewer tokens than this before the prompt's
        end (a policy that scores the prompt with its last queries needs them together)."""
        return 0


class NoPolicy(Policy):
    """vLLM unchanged."""

    name = "none"
    summary = "everything; vLLM is untouched (tested identical to stock vLLM)"


class BudgetedPolicy(Policy):
    """A token budget: a request keeps at most `budget` tokens past its prompt (`sinks + window`
    for a window policy), plus lazy pruning's slack."""

    settings = (BUDGET, SINKS, WINDOW, PRUNE_INTERVAL)

    def validate(self, config: KVPolicyConfig, name_of: NameOf) -> KVPolicyConfig:
        budget = self._resolved_budget(config, name_of)
        if config.sinks >= budget:
            raise KVConfigError(name_of("sinks"), f"must be smaller than the budget ({budget}), got {config.sinks}")
        return config.replace(budget=budget)

    @staticmethod
    def _resolved_budget(config: KVPolicyConfig, name_of: NameOf) -> int:
        if config.budget is None and config.window is None:
            raise KVConfigError(name_of("budget"), f"policy {config.name!r} needs a budget (tokens kept)")
        if config.budget is None:
            return config.sinks + config.window
        if config.window is not None and config.window != config.budget - config.sinks:
            raise KVConfigError(name_of("window"), f"window {config.window} + sinks {config.sinks} must equal the "
                                                   f"budget {config.budget}")
        return config.budget

    def merge_overrides(self, config: KVPolicyConfig, overrides: Mapping[str, Any]) -> Mapping[str, Any]:
        # budget = sinks + window: whichever of budget and window is overridden alone wins, and
        # the other is derived from it again.
        if "budget" in overrides and "window" not in overrides:
            return {"window": None}
        if "window" in overrides and "budget" not in overrides:
            return {"budget": None}
        return {}

    def check_engine(self, config: KVPolicyConfig, block_size: int, surface: Surface) -> None:
        if config.budget < block_size:
            raise KVConfigError(surface.name("budget"), f"{config.budget} tokens cannot hold one KV block (block size "
                                                        f"{block_size}); use at least {block_size} or a smaller "
                                                        "--block-size")

    def cap_blocks(self, config: KVPolicyConfig, block_size: int) -> int:
        """The budget plus lazy pruning's R - 1 tokens of slack, and the new token."""
        return math.ceil((config.budget + config.prune_interval) / block_size)

    def explain_capacity(self, config: KVPolicyConfig, block_size: int) -> str:
        cap = self.cap_blocks(config, block_size)
        if config.prefill == "streaming":
            return (f"budget {config.budget} - 1 + prefill_chunk {config.prefill_chunk} tokens while a prompt is "
                    f"streamed, {cap} blocks after it")
        return f"budget {config.budget} + prune_interval {config.prune_interval} tokens: {cap} blocks after the prompt"


class HeadScorerPolicy(BudgetedPolicy):
    """A budgeted policy of the `heads` layout: every layer and KV head keeps its own tokens,
    every head the same count. It scores each cached token per head in a table beside the
    cache (`worker/layouts/heads.HeadMass`); a decode eviction takes each head's lowest-scored
    tokens outside the `protected` ones (ties to the oldest), and a subclass decides what the
    scores are: it keeps attention mass (`keeps_attention_mass`, added by the mass kernel in
    every step) and/or sets them when it prunes a prompt (`prefill_survivors`)."""

    layout = "heads"
    # The variant that `allocation: pyramid / adaptive` runs (`policies/allocation.SpreadBudget`),
    # for a scorer that reads `allocation`.
    spread: ClassVar[Policy | None] = None

    def for_config(self, config: KVPolicyConfig) -> Policy:
        if self.spread is not None and getattr(config, "allocation", "uniform") != "uniform":
            return self.spread
        return self

    def check_request(self, engine: KVPolicyConfig, request: KVPolicyConfig, name_of: NameOf) -> None:
        from vllm_kvprune.policies import allocation

        allocation.check_request(engine, request, name_of)

    def check_parallel(self, config: KVPolicyConfig, tensor_parallel_size: int, surface: Surface) -> None:
        from vllm_kvprune.policies import allocation

        allocation.check_parallel(config, tensor_parallel_size, surface)

    def protected(self, config: KVPolicyConfig) -> tuple[int, int]:
        """How many of the oldest (`sinks`) and newest (`recent`) tokens no eviction takes."""
        return 0, 0

    def evicted(self, scores: torch.Tensor, slots: torch.Tensor, logical: torch.Tensor, count: int,
                next_position: int, config: KVPolicyConfig) -> torch.Tensor:
        """Indices into `slots` `[n]` (a request's global slots), `[layers, heads, count]`, of
        the tokens each layer's heads evict: lowest `scores` (the table `[layers, heads,
        num_slots]`), outside the protected tokens before `next_position`; the slots hold
        positions `logical` `[layers, heads, n]`."""
        from vllm_kvprune import kernels

        return kernels.lowest_mass_slots(scores, slots, logical, count, next_position, *self.protected(config))

    def evicted_many(self, scores: torch.Tensor, searches: list) -> list[torch.Tensor]:
        """`evicted` for several requests of one step at once (each `kernels.victims.VictimSearch`
        carries its request's protected counts): where the table is, in one pass on a device."""
        from vllm_kvprune import kernels

        return kernels.lowest_mass_slots_many(scores, searches)

    def prompt_keep(self, config: KVPolicyConfig, num_prompt: int) -> int | None:
        """Tokens each head keeps of a prompt of `num_prompt` once a layer has attended to all
        of it (`prefill_survivors` chooses them), None to leave the prompt as it is: by the
        step rule, `budget - 1` when the next token would evict."""
        return config.budget - 1 if config.evicts_before(num_prompt, 1) else None

    def prefill_survivors(self, scores: torch.Tensor, slots: torch.Tensor, keep: int, config: KVPolicyConfig,
                          prompt: Any = None) -> torch.Tensor:
        """Indices into a prompt's `slots` `[P]` (= prompt positions) that each head of one
        layer keeps, ascending `[heads, keep]`; `scores` is that layer's table `[heads,
        num_slots]` (a policy may set its kept tokens' scores there), `prompt` a
        `worker/layouts/heads.PromptView` (the prompt's last queries and its keys)."""
        num_heads, num_tokens = scores.shape[0], len(slots)
        positions = torch.arange(num_tokens).expand(1, num_heads, -1)
        evicted = self.evicted(scores[None], slots, positions, num_tokens - keep, num_tokens, config)[0]
        kept = torch.ones(num_heads, num_tokens, dtype=torch.bool)
        kept.scatter_(1, evicted, False)
        return torch.arange(num_tokens).expand(num_heads, -1)[kept].view(num_heads, keep)
