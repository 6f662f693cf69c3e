"""Recipes: the train options for the targets users bring, each value with where it comes from.

A recipe is named on the command line (`dflash-train train --recipe qwen3-8b ...`, or
`recipe: qwen3-8b` in a `--config` file). Its values sit just above the defaults: a `--config`
file and the flags given override any of them (`TrainConfig.from_layers`), and the run's saved
config records the recipe's name beside every resolved value. `dflash-train recipes` lists them,
`dflash-train recipes NAME` shows one value by value with its source.

Sources, cited in each `Setting`: the DFlash paper's recipe, the drafters z-lab and others
published (their config.json), and this project's own measurements (docs, Objectives and
DFlash 2). Where a value is a convention nobody here has measured against another, its source
says "convention".

Pure data (no project imports): `config.py` expands a named recipe, and the `recipes` command
(`train/recipe_command.py`) prints them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Setting:
    """One option's value in a recipe and where it comes from."""

    value: Any
    source: str


@dataclass(frozen=True)
class Requirement:
    """An option the user must give for the recipe to run, while `when` (option, value) holds."""

    option: str
    when: tuple[str, Any]
    why: str


@dataclass(frozen=True)
class Recipe:
    """Train options for one kind of target, with the facts the command prints beside them."""

    name: str
    target: str
    """The model the recipe is for, as users name it."""
    family: str
    """Its `model_type` (the test zoo's family: `tests/target_zoo.py`)."""
    summary: str
    """One line: where the target and the drafters run."""
    settings: dict[str, Setting]
    target_layers: int | None = None
    """Decoder layers of the named target (the paper's rule spreads the feature ids over them)."""
    requires: tuple[Requirement, ...] = ()
    notes: tuple[str, ...] = ()
    """What to do before and after training: data, serving, what is not verified."""

    def values(self) -> dict[str, Any]:
        """The options the recipe sets, flat by name (a `TrainConfig.from_layers` layer)."""
        return {name: s.value for name, s in self.settings.items()}


# ----------------------------------------------------------------------------- shared values
PAPER = "the DFlash paper's recipe (arXiv 2602.06036)"

DRAFTER = {
    "draft_layers": Setting(
        5,
        "the DFlash paper's drafter (5 layers; 8 for a coder target), as z-lab's published "
        "Qwen3 drafters",
    ),
    "block_size": Setting(
        16, "the DFlash paper's block size; z-lab's published Qwen3 drafters (b16)"
    ),
    "num_target_features": Setting(
        5,
        "the DFlash paper's K = 5 target layers, their ids spread over the depth by its rule "
        "round(1 + i (L - 4) / 4), as z-lab's published drafters (docs, Correctness)",
    ),
}
SLIDING = {
    "sliding_window": Setting(
        2048,
        "convention: the layout of recent published drafters, every layer a 2048-token "
        "window but the top one, which sees the whole context (z-lab's Qwen3.6-27B drafter: "
        "4 sliding layers under 1 full; its Qwen3 and Qwen3.5 ones are all full; docs, "
        "train's --sliding-window: alone it keeps the top layer full); not measured against "
        "all-full layers here",
    ),
}
OBJECTIVE = {
    "position_weights": Setting(
        "dpace",
        "docs, Objectives: D-PACE with Muon 8.00 tau vs the paper's decay with AdamW 5.42 "
        "(DFlash 1, demo target, 3 seeds); the D-PACE paper reports +8.5-12.8% tau on "
        "Qwen3-4B/8B (arXiv 2605.18810)",
    ),
    "optimizer": Setting(
        "muon",
        "docs, Objectives: the largest effect measured after DFlash 2 itself (+2.58 tau "
        "DFlash 1, +1.02 DFlash 2 on the demo target, 3 seeds; tiny targets only)",
    ),
    "lr": Setting(6e-4, f"{PAPER}: AdamW's peak rate; Muon's is 2x (the docs' 300-step sweep)"),
    "warmup_ratio": Setting(0.04, f"{PAPER}: cosine schedule, 4% warm-up"),
    "grad_clip": Setting(1.0, PAPER),
    "epochs": Setting(6, f"{PAPER}: 6 epochs of about 800K conversations"),
    "num_anchors": Setting(512, f"{PAPER}: up to 512 random anchors per sequence"),
}


def one_node(target: str = "cuda:0", drafters: int = 7) -> dict[str, Setting]:
    """One target GPU feeding the node's other GPUs as drafters."""
    why = (
        "convention: one target GPU feeds about 7 drafter GPUs (a public 8xH200 DFlash "
        "training run: 1 target server, 7 trainers; docs, Performance, for this pipeline's "
        "balance)"
    )
    return {
        "target_devices": Setting([target], why),
        "drafter_devices": Setting([f"cuda:{i}" for i in range(1, drafters + 1)], why),
    }


def recipe(name: str, target: str, family: str, summary: str, *parts: dict, **kw) -> Recipe:
    """A `Recipe` whose settings are `parts` merged in order (later ones win)."""
    settings: dict[str, Setting] = {}
    for part in parts:
        settings.update(part)
    return Recipe(name, target, family, summary, settings, **kw)


DFLASH2_SHIPPED = "the value published DFlash 2 checkpoints ship (their dflash_config)"
REGENERATE = (
    "data: responses regenerated by the target in the chat mode it will serve "
    "(`dflash-train regenerate --thinking on|off`), then `prepare --max-length 3072` (the "
    "DFlash paper's recipe)"
)


# ----------------------------------------------------------------------------- the recipes
RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        recipe(
            "qwen3-8b",
            "Qwen/Qwen3-8B",
            "qwen3",
            "one 8-GPU node: the target on cuda:0, 7 drafter GPUs",
            DRAFTER,
            SLIDING,
            OBJECTIVE,
            one_node(),
            target_layers=36,
            notes=(
                REGENERATE + "; the paper's headline numbers are thinking off",
                "mask token: the tokenizer's <|MASK|> (id 151669), as z-lab's Qwen3-8B drafter",
                "z-lab's published Qwen3-8B drafter has the same layers, block and target layer "
                "ids, every layer full attention (it predates the sliding layout)",
            ),
        ),
        recipe(
            "llama-3.1-8b",
            "meta-llama/Llama-3.1-8B-Instruct",
            "llama",
            "one 8-GPU node: the target on cuda:0, 7 drafter GPUs",
            DRAFTER,
            SLIDING,
            OBJECTIVE,
            one_node(),
            target_layers=32,
            notes=(
                REGENERATE,
                "mask token: Llama 3.1's tokenizer fills its 128,256 embedding rows and has no "
                "<|MASK|>: the first reserved special token is chosen (said in the run's log)",
                "RoPE: the drafter takes the target's llama3 scaling, read alike by every "
                "serving engine (docs, RoPE as served)",
            ),
        ),
        recipe(
            "qwen3.6-35b-a3b",
            "Qwen/Qwen3.6-35B-A3B",
            "qwen3_5_moe",
            "one 8-GPU node: a tensor-parallel 2 vLLM engine on cuda:0,1, 6 drafter GPUs",
            DRAFTER,
            SLIDING,
            OBJECTIVE,
            {
                "target_backend": Setting(
                    "vllm",
                    "about 70 GB of bf16 weights: one vLLM engine, tensor-parallel, instead of "
                    "a copy per device (docs, On paper: a 35B-A3B target)",
                ),
                "target_tp": Setting(2, "35 GB of weights per GPU, the rest for vLLM's caches"),
                "target_devices": Setting(["cuda:0", "cuda:1"], "the engine's GPUs"),
                "drafter_devices": Setting(
                    [f"cuda:{i}" for i in range(2, 8)], "the node's other 6 GPUs"
                ),
                "engine_args": Setting(
                    '{"enable_expert_parallel": true}',
                    "spreads the 256 experts over the engine's GPUs (docs, On paper)",
                ),
            },
            target_layers=40,
            notes=(
                REGENERATE,
                "give --vllm-python (the interpreter of vLLM's environment) unless vLLM is in "
                "this one",
                "mask token: the first spare embedding row (248077 for a Qwen3.5/3.6 tokenizer, "
                "the id z-lab's Qwen3.6-35B-A3B drafter uses)",
                "not verified: the hybrid Gated DeltaNet layers through vLLM's hidden-state "
                "extraction, and every GPU figure (docs, On paper)",
            ),
        ),
        recipe(
            "gpt-oss-20b",
            "openai/gpt-oss-20b",
            "gpt_oss",
            "one 8-GPU node: the target on cuda:0 (about 42 GB in bf16), 7 drafter GPUs",
            DRAFTER,
            SLIDING,
            OBJECTIVE,
            one_node(),
            target_layers=24,
            notes=(
                REGENERATE + " (the harmony chat template: keep the reasoning effort you serve)",
                "the MXFP4 experts are dequantised on load to the run's dtype and the target "
                "runs with eager attention (docs, Target families)",
            ),
        ),
        recipe(
            "deepseek-v3",
            "deepseek-ai/DeepSeek-V3 (also DeepSeek-R1 and Kimi K2: the same MLA layout)",
            "deepseek_v3",
            "the target on a vLLM engine on its own node(s), all 8 GPUs of the trainer's node "
            "as drafters",
            DRAFTER,
            SLIDING,
            OBJECTIVE,
            {
                "target_backend": Setting(
                    "vllm",
                    "671B parameters (Kimi K2: 1T) fill a node: a vLLM engine already running "
                    "elsewhere computes the features (docs, Starting the engine: two ways)",
                ),
                "target_devices": Setting(
                    ["cpu"], "the target workers only wait on the network (docs, as above)"
                ),
                "target_workers": Setting(
                    8, "one batch in flight per worker, 8 workers (docs, On paper: 8 workers)"
                ),
                "drafter_devices": Setting(
                    [f"cuda:{i}" for i in range(8)], "the trainer's node is all drafters"
                ),
            },
            target_layers=61,
            requires=(
                Requirement(
                    "target_endpoint",
                    ("target_backend", "vllm"),
                    "the URL of the engine, started on the target's node with "
                    "`python -m dflash_train.engine.server --target DIR --target-layer-ids "
                    "1,15,30,44,58 --tensor-parallel-size 8 --host 0.0.0.0 --port 8100` "
                    "(docs, Starting the engine: two ways)",
                ),
            ),
            notes=(
                REGENERATE,
                "the drafter copies the target's shape: its 128 heads at v_head_dim 128 (MLA "
                "has no key width of its own) and its dense MLP width (docs, Target "
                "families), so each draft layer is large; the run's log prints its size",
                "features: 5 x 7168 x 2 B = 70 KiB per token cross the network inline "
                "(docs, On paper, for the rates measured)",
                "RoPE: the target's YaRN without mscale / mscale_all_dim (docs, RoPE as served)",
            ),
        ),
        recipe(
            "gemma-3",
            "google/gemma-3-27b-it (any Gemma 3 size: the feature ids follow its depth)",
            "gemma3",
            "one 8-GPU node: the target on cuda:0, 7 drafter GPUs",
            DRAFTER,
            SLIDING,
            OBJECTIVE,
            one_node(),
            target_layers=62,
            notes=(
                REGENERATE,
                "the checkpoint is the multimodal wrapper: its text model is loaded, the vision "
                "tower never; the block embedding is scaled as Gemma's (exported as "
                "dflash_config.input_embedding_scale) (docs, Target families)",
                "serving: neither vLLM nor SGLang captures DFlash features of a Gemma 3 target "
                "yet (their source, read 2026-12-01): `eval` and the reference client run it",
            ),
        ),
        recipe(
            "qwen3.5-dflash2",
            "a Qwen3.5-class target (e.g. Qwen/Qwen3.5-4B), DFlash 2",
            "qwen3_5",
            "one 8-GPU node: the target on cuda:0, 7 drafter GPUs",
            DRAFTER,
            SLIDING,
            OBJECTIVE,
            one_node(),
            {
                "arch": Setting(
                    "dflash2",
                    "docs, DFlash 2: +2.39 tau over DFlash 1 on the demo target (3 seeds), "
                    "+1.05 on the GSM8K target; the authors' write-ups report tau 5.97 vs 4.92 "
                    "on Qwen3.5-4B",
                ),
                "block_size": Setting(
                    8, "the published DFlash 2 drafter for Qwen3.8-27B (others use 16)"
                ),
                "full_attention_layers": Setting(
                    0,
                    "published DFlash 2 drafters: every layer a 2048-token window, "
                    "bidirectional in the block (their config.json: is_causal false)",
                ),
                "conv_kernel_size": Setting(2, DFLASH2_SHIPPED),
                "conv_group_size": Setting(16, DFLASH2_SHIPPED),
                "selector_rank": Setting(256, DFLASH2_SHIPPED),
                "selector_top_k": Setting(16, DFLASH2_SHIPPED),
                "selector_loss_weight": Setting(
                    1.0,
                    "convention: vLLM speculators, SpecForge and NeMo Automodel all use 1.0 "
                    "(no objective is published)",
                ),
                "selector_misses": Setting(
                    "exclude", "docs, DFlash 2: a tie with inject at 3 seeds; convention"
                ),
                "selector_backbone_grad": Setting(
                    True, "docs, DFlash 2: stop-gradient lost 0.52 tau (one seed)"
                ),
            },
            notes=(
                REGENERATE + "; the authors' Qwen3.5-4B numbers are thinking on, T = 1",
                "the hybrid Gated DeltaNet layers run slowly in transformers without the GPU "
                "packages causal-conv1d and flash-linear-attention: install them",
                "serving: vLLM (0.32+, GPU) and SGLang serve DFlash2DraftModel; vLLM's CPU "
                "build does not",
            ),
        ),
    )
}
"""Every recipe, by name."""


def get_recipe(name: str) -> Recipe:
    """The recipe `name`, or one `ValueError` naming the recipes there are."""
    if name not in RECIPES:
        raise ValueError(
            f"unknown recipe {name!r}; the recipes are {', '.join(RECIPES)} "
            "(`dflash-train recipes` shows them)"
        )
    return RECIPES[name]


def unmet_requirements(recipe: Recipe, value_of: Any) -> list[str]:
    """Lines for the requirements of `recipe` that the resolved options (`value_of(name)`) do
    not meet."""
    out = []
    for req in recipe.requires:
        option, value = req.when
        if value_of(option) == value and not value_of(req.option):
            flag = "--" + req.option.replace("_", "-")
            out.append(f"recipe {recipe.name} needs {flag}: {req.why}")
    return out
