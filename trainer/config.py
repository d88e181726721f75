"""The trainer's configuration: one typed dataclass per component, composed by Hydra from ``trainer/conf``.

Every default runs on a 2-core CPU machine with the bundled model. Override from the command line::

    python -m trainer env=arithmetic algorithm=dr_grpo trainer.lr=2e-6 trainer.steps=50

Derived values are properties, and ``__post_init__`` checks fail fast with a message that says what to change.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from hydra.core.config_store import ConfigStore

from envkit.ref import EnvRef
from generators.engines.base import check_cpu_cores
from generators.engines.factory import EngineConfig
from generators.engines.weight_sync import WeightSyncConfig
from generators.rollout import GeneratorConfig
from generators.trajectory import STOP_REASONS

ADVANTAGES = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae")
POLICY_LOSSES = ("ppo", "gspo")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the fix."""


STAGES = ("sft", "rl", "distill", "online")
SFT_DATA = ("demos", "trajectories", "chat")
TASK_SOURCES = ("auto", "env", "seeds", "dataset")
SANDBOXES = ("docker", "local", "auto")


@dataclass
class TaskSourceConfig:
    """Where an env's episodes come from, per split (see ``trainer/sources.py``)."""

    source: str = "auto"
    """auto (the env's own task lists when it has them, else seeds), env, seeds, or dataset."""
    train_seeds: list[int] = field(default_factory=lambda: [0, 1_000_000])
    """``[start, stop)``: the seeds training episodes are reset with (source seeds)."""
    eval_seeds: list[int] = field(default_factory=lambda: [1_000_000, 1_001_000])
    """``[start, stop)`` of the held-out episodes; must not overlap ``train_seeds``."""
    dataset: str | None = None
    """A JSONL/JSON/Parquet/CSV file or a ``datasets`` ``save_to_disk`` dir whose rows are the tasks."""
    eval_dataset: str | None = None
    """The held-out rows' file (else ``eval_rows`` rows of ``dataset`` are held out)."""
    eval_rows: int = 0
    """Rows of ``dataset`` held out for evaluation (a seeded split) when there is no ``eval_dataset``."""
    columns: dict[str, str] = field(default_factory=dict)
    """Task field -> dataset column, e.g. ``{question: problem, answer: solution}``; other columns pass through."""
    shuffle: bool = True
    """Shuffle the train tasks every epoch (seeds are drawn in order: each is a fresh episode)."""

    def __post_init__(self) -> None:
        _one_of("env.tasks.source", self.source, TASK_SOURCES)
        for name in ("train_seeds", "eval_seeds"):
            seeds = getattr(self, name)
            if len(seeds) != 2 or not seeds[0] < seeds[1]:
                raise ConfigError(f"env.tasks.{name} must be [start, stop) with start < stop, got {list(seeds)}")
        (a, b), (c, d) = self.train_seeds, self.eval_seeds
        if a < d and c < b:
            raise ConfigError(f"env.tasks.train_seeds {[a, b]} and env.tasks.eval_seeds {[c, d]} overlap: the "
                              "held-out evaluation must never see a training seed")
        if self.source == "dataset" and not self.dataset:
            raise ConfigError("env.tasks.source=dataset needs env.tasks.dataset=PATH (a JSONL, JSON, Parquet or CSV "
                              "file, or a datasets save_to_disk dir)")
        if self.eval_rows < 0:
            raise ConfigError(f"env.tasks.eval_rows must be >= 0, got {self.eval_rows}")


@dataclass
class EnvConfig:
    """An environment to train on, where it runs, and where its episodes come from; or a weighted ``mixture``."""

    name: str = "arithmetic"
    """A registered env name (``envkit list``), ``ws://host:port/NAME`` or ``http://...`` (an ``envkit serve``
    server), ``openenv:http://host:port``, ``gym:ID``, or ``package.module:EnvClass``."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Constructor arguments for ``envkit.make`` (for a server: its session's kwargs)."""
    sandbox: str | None = None
    """Run each rollout's env in a sandbox: docker, local (an ``envkit serve`` child process) or auto."""
    pool_size: int = 0
    """Sandboxes kept warm for the run (0: one per concurrent rollout)."""
    train_split: str = "train"
    """The env's task split training draws from (``tasks(split)``)."""
    eval_split: str = "test"
    """The split the held-out evaluations draw from; never trained on."""
    tasks: TaskSourceConfig = field(default_factory=TaskSourceConfig)
    weight: float = 1.0
    """Share of each step's prompts in a mixture."""
    label: str | None = None
    """The env's name in metrics and reports (default: derived from ``name``)."""
    mixture: list[EnvConfig] = field(default_factory=list)
    """Train on these envs instead, each step drawing prompts in proportion to their ``weight``."""

    @property
    def members(self) -> list[EnvConfig]:
        """The envs of the run: the mixture's, or this one."""
        return list(self.mixture) or [self]

    @property
    def ref(self) -> EnvRef:
        """This env as envkit's one reference to an env (what the run's env streams and env workers pass)."""
        return EnvRef(self.name, dict(self.kwargs), sandbox=self.sandbox, label=self.label)

    @property
    def display_name(self) -> str:
        """The label, else a short name: a gym id, ``openenv``, a URL's env name, an entry point's class."""
        return self.ref.display_name

    def __post_init__(self) -> None:
        if self.sandbox is not None:
            _one_of("env.sandbox", self.sandbox, SANDBOXES)
        try:
            self.ref  # noqa: B018 - what makes it checks the name and kwargs
        except ValueError as e:
            raise ConfigError(f"env: {e}") from None
        if self.pool_size < 0:
            raise ConfigError(f"env.pool_size must be >= 0, got {self.pool_size}")
        if not self.weight > 0:
            raise ConfigError(f"env.weight must be > 0, got {self.weight}")
        labels = [m.display_name for m in self.mixture]
        if len(set(labels)) < len(labels):
            raise ConfigError(f"env.mixture has envs with the same label ({', '.join(labels)}): give each a "
                              "distinct `label`")
        if any(m.mixture for m in self.mixture):
            raise ConfigError("env.mixture entries cannot hold mixtures themselves")


@dataclass
class LoraConfig:
    """LoRA adapters (``peft``) instead of full fine-tuning: the base weights stay frozen and only the adapters (and
    PPO's value head) train, so gradients and optimizer state exist for them alone. The engine serves the policy
    with the adapters merged into the base weights, or as adapters (``serve``), and the KL reference is the policy
    with its adapters off."""

    r: int = 0
    """Adapter rank; 0 is full fine-tuning (every weight trains)."""
    alpha: float = 32.0
    """The adapters' output is scaled by ``alpha / r``."""
    dropout: float = 0.0
    """Dropout on the adapters' input while training."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Names (or name suffixes) of the linear layers that get an adapter, e.g. ``[q_proj, v_proj]``; ``all-linear``
    is every linear layer but the output head."""
    serve: str = "auto"
    """How the engine serves them. ``merged``: into the base weights, a model per engine. ``adapters`` (a run with
    seats, on vLLM): one server serves the base model and each policy as a LoRA adapter, its few MB loaded in place
    after every step; the starting model that evaluation plays against is the base model on that server. ``auto``:
    adapters for a run of several policies on vLLM's GPU build, where two servers would split one GPU's memory;
    merged otherwise. On the CPU build vLLM's LoRA kernels cost more time than two servers' contention: as
    adapters, two policies' referential step took 1.21x as long as merged, in 0.65x the memory
    (benchmarks/two_policies.py --lora)."""

    @property
    def enabled(self) -> bool:
        return self.r > 0

    def __post_init__(self) -> None:
        _one_of("model.lora.serve", self.serve, ("auto", "merged", "adapters"))
        if self.r < 0:
            raise ConfigError(f"model.lora.r must be >= 0 (0: full fine-tuning), got {self.r}")
        if not self.enabled:
            return
        if not self.alpha > 0:
            raise ConfigError(f"model.lora.alpha must be > 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"model.lora.dropout must be in [0, 1), got {self.dropout}")
        if not self.target_modules:
            raise ConfigError("model.lora.target_modules is empty: name the layers to adapt, e.g. [q_proj, v_proj], "
                              "or [all-linear]")


@dataclass
class ModelConfig:
    """The initial policy."""

    path: str = "bundled"
    """``bundled`` (SmolLM2-135M-Instruct) or an HF checkpoint dir."""
    policy_paths: dict[str, str] = field(default_factory=dict)
    """With seats: a policy's starting weights (an HF checkpoint dir) by its name; the others start from ``path``.
    A run of stages sets it for the policy its sft stage trained (``sft.policy``)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Train LoRA adapters instead of every weight (``model.lora.r > 0``)."""


@dataclass
class AlgorithmConfig:
    """Advantage estimator, policy loss and regularizers (see ``trainer/algorithms.py``)."""

    advantage: str = "grpo"
    """One of grpo, dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline, or gae (PPO: token-level GAE from a value
    head trained alongside the policy)."""
    policy_loss: str = "ppo"
    """ppo (clipped surrogate, token ratios) or gspo (sequence ratios)."""
    aggregation: str = "token-mean"
    """token-mean, seq-mean-token-mean, or seq-mean-token-sum-norm (Dr. GRPO)."""
    clip_low: float = 0.2
    """PPO's lower clip: token ratios below ``1 - clip_low`` stop pulling a negative advantage."""
    clip_high: float = 0.28
    """DAPO clip-higher: the upper clip may exceed the lower one."""
    dual_clip: float | None = None
    """Dual-clip PPO's c > 1: caps a negative-advantage token's loss at c times the advantage's size (null: off)."""
    kl_coef: float = 0.0
    """Weight of KL(policy || initial policy) in the loss; > 0 keeps a frozen reference model."""
    kl_kind: str = "k3"
    """The KL estimator: k1 (log ratio), k2 (half its square) or k3 (the unbiased, non-negative one)."""
    entropy_coef: float = 0.0
    """Weight of an entropy bonus in the loss (0: none)."""
    tis_cap: float | None = 2.0
    """Truncated importance sampling cap on exp(trainer - sampler logprob); None turns TIS off."""
    filter_zero_variance_groups: bool = True
    """Drop groups whose rewards are all equal: their advantages are 0 and only cost compute."""
    gamma: float = 1.0
    """GAE discount over model tokens."""
    lam: float = 0.95
    """GAE lambda."""
    vf_coef: float = 0.1
    """Weight of the value loss (GAE only)."""
    value_clip: float | None = 0.2
    """PPO value clipping around the values before the update; None turns it off."""

    @property
    def critic(self) -> bool:
        """Whether the policy carries a value head (token-level GAE advantages)."""
        return self.advantage == "gae"

    def __post_init__(self) -> None:
        _one_of("algorithm.advantage", self.advantage, ADVANTAGES)
        _one_of("algorithm.policy_loss", self.policy_loss, POLICY_LOSSES)
        _one_of("algorithm.aggregation", self.aggregation, AGGREGATIONS)
        _one_of("algorithm.kl_kind", self.kl_kind, ("k1", "k2", "k3"))
        if not (0 <= self.clip_low < 1 and self.clip_high >= 0):
            raise ConfigError(f"algorithm.clip_low must be in [0, 1) and algorithm.clip_high >= 0, got "
                              f"{self.clip_low}, {self.clip_high}")
        if self.dual_clip is not None and (self.dual_clip <= 1 or self.policy_loss != "ppo"):
            raise ConfigError(f"algorithm.dual_clip must be > 1 (or null), and is policy_loss=ppo's; got "
                              f"{self.dual_clip} with policy_loss={self.policy_loss}")
        if not (0 <= self.gamma <= 1 and 0 <= self.lam <= 1):
            raise ConfigError(f"algorithm.gamma and algorithm.lam must be in [0, 1], got {self.gamma}, {self.lam}")
        if self.tis_cap is not None and self.tis_cap < 1:
            raise ConfigError(f"algorithm.tis_cap must be >= 1 (or null), got {self.tis_cap}")


@dataclass
class RolloutConfig(GeneratorConfig):
    """How each step samples training data: the generator's settings (shared with ``envkit eval``) with the
    trainer's defaults, plus the prompts per step. The defaults are sized for ``make train`` on 2 CPU cores: 64
    rollouts per step, short answers."""

    prompts_per_step: int = 8
    """Tasks (or seeds) drawn per step; each becomes a group of ``samples_per_prompt`` rollouts."""
    samples_per_prompt: int = 8
    """The GRPO group size."""
    max_tokens: int = 48
    max_turns: int = 4
    max_total_tokens: int = 1024
    timeout_s: float = 120.0
    concurrency: int = 128
    deadline_floor_s: float = 50.0
    """Once a step has finished, a rollout is cut (stop reason ``timeout``, counted) at max(``deadline_steps`` × the
    slowest step so far, this), never later than ``timeout_s`` (the first step's limit): a hung part (an env server
    that stopped, an agent that never calls the gateway) costs each step that, not the whole timeout. The defaults
    leave the step that hits the limit room to end and report it within max(2 × the slowest step, 60 s)."""
    deadline_steps: float = 1.8
    """See ``deadline_floor_s``."""

    @property
    def batch_size(self) -> int:
        """Rollouts per step."""
        return self.prompts_per_step * self.samples_per_prompt

    def generator_config(self, **changes: Any) -> GeneratorConfig:
        """These settings with ``changes`` as a plain GeneratorConfig, free of the trainer's checks (an
        evaluation may be greedy)."""
        return GeneratorConfig(**{**{f.name: getattr(self, f.name) for f in fields(GeneratorConfig)}, **changes})

    def __post_init__(self) -> None:
        try:
            super().__post_init__()
        except ValueError as e:
            raise ConfigError(f"generator.{e}") from None
        if self.prompts_per_step < 1:
            raise ConfigError(f"generator.prompts_per_step must be >= 1, got {self.prompts_per_step}")
        if self.deadline_floor_s <= 0 or self.deadline_steps < 1:
            raise ConfigError("generator.deadline_floor_s must be > 0 and generator.deadline_steps >= 1, got "
                              f"{self.deadline_floor_s} and {self.deadline_steps}")
        if self.temperature <= 0:
            raise ConfigError("generator.temperature must be > 0: training needs sampled, not greedy, rollouts")


@dataclass
class SFTConfig:
    """The supervised stage (``stages=[sft]``, or ``[sft, rl]`` to run GRPO from its weights; trainer/sft.py): the
    mean negative log-likelihood of the model's own tokens (loss_mask 1), so prompts, tool outputs and env turns
    are never trained on. Backend, LoRA, micro-batching, checkpoints and evaluation are the ``trainer``'s."""

    data: str = "demos"
    """demos (the run's env demonstrates its train tasks, played for real in its sandbox: ``Env.demonstrate``),
    trajectories (JSONL written by ``envkit eval`` or a training run, filtered below: rejection sampling), or chat
    (rows with ``messages`` and optional ``tools``: JSONL, JSON, Parquet or a ``datasets`` save_to_disk dir)."""
    paths: list[str] = field(default_factory=list)
    """trajectories: the JSONL files; chat: the dataset file or dir (one)."""
    num_demos: int = 256
    """demos: how many train tasks are demonstrated (the first of the env's train split)."""
    min_reward: float | None = 1.0
    """demos and trajectories: keep episodes with at least this reward (null keeps every reward)."""
    envs: list[str] = field(default_factory=list)
    """trajectories: keep these env names only (empty keeps all)."""
    stop_reasons: list[str] = field(default_factory=lambda: ["done"])
    """trajectories: keep episodes that stopped for one of these reasons."""
    eval_fraction: float = 0.1
    """Share of the data held out for the held-out loss (seeded; at least one sequence when there are two)."""
    epochs: int = 2
    """Passes over the SFT data."""
    batch_size: int = 16
    """Sequences per optimizer step."""
    lr: float = 1e-4
    """Peak learning rate of the supervised stage."""
    eval_every: int = 0
    """Held-out loss every k optimizer steps (0: before and after training only)."""
    policy: str | None = None
    """With seats: the policy this stage trains on its seats' demonstrations (``sft.paths``); the rl stage starts it
    from the stage's weights, and the other policies from ``model.path``."""

    def __post_init__(self) -> None:
        _one_of("sft.data", self.data, SFT_DATA)
        for name in ("epochs", "batch_size", "num_demos"):
            if getattr(self, name) < 1:
                raise ConfigError(f"sft.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.eval_fraction < 1:
            raise ConfigError(f"sft.eval_fraction must be in [0, 1), got {self.eval_fraction}")
        if self.lr <= 0:
            raise ConfigError(f"sft.lr must be > 0, got {self.lr}")
        if self.eval_every < 0:
            raise ConfigError(f"sft.eval_every must be >= 0, got {self.eval_every}")
        if self.data != "demos" and not self.paths:
            raise ConfigError(f"sft.data={self.data} needs sft.paths=[...]: the trajectory JSONL files, or the chat "
                              "dataset")
        if self.data == "chat" and len(self.paths) != 1:
            raise ConfigError(f"sft.data=chat reads one dataset; got sft.paths={list(self.paths)}")
        for reason in self.stop_reasons:
            _one_of("sft.stop_reasons", reason, STOP_REASONS)


@dataclass
class CurriculumConfig:
    """Which train tasks each step draws (trainer/curriculum.py), per env of the run, and the pass rates it keeps.
    ``band`` draws the tasks whose groups have variance, and sets the solved and the hopeless aside."""

    sampler: str = "uniform"
    """uniform (every task once per epoch, shuffled), band (tasks with a pass rate inside ``band``, and untried
    ones), bandit (the band's tasks in cells, each draw to the cell whose groups varied most lately), or
    ``package.module:Class`` (a ``trainer.curriculum.Sampler`` subclass)."""
    pass_rates: list[str] = field(default_factory=list)
    """Files ``envkit eval --pass-rates`` wrote (of the train split): the tasks' starting pass rates; else every
    task starts untried. The run keeps them live from its own rollouts."""
    pass_threshold: float = 1.0
    """An episode passes with at least this reward."""
    window: int = 16
    """A task's pass rate is over its latest this-many episodes."""
    band: list[float] = field(default_factory=lambda: [0.1, 0.9])
    """band and bandit: ``[low, high]``: a task tried ``min_tries`` times with a pass rate above high (solved) or
    below low (hopeless) is set aside."""
    min_tries: int = 4
    """band and bandit: episodes of a task before its pass rate can set it aside."""
    retry: float = 0.1
    """band (bandit learns it per cell): the chance that a draw goes to a set-aside task instead (one that became
    learnable comes back)."""
    min_active: int = 32
    """band (bandit has no floor): the fewest tasks it draws from: while fewer are in the band (or untried), the
    set-aside tasks nearest it rejoin, the hopeless first, each rate pulled toward the pool's by two tries (0: no
    floor)."""
    group_by: list[str] = field(default_factory=list)
    """band and bandit: task fields whose values together name a group of tasks that share a difficulty (e.g.
    ``[level]``, or ``[level,ops]``): band's floor brings back first the hopeless tasks of the group whose hopeless
    tasks passed most when drawn again; bandit keeps cells per group (empty: no groups)."""
    refill: int = 0
    """Dynamic sampling: up to this many rounds per step that draw one more prompt for each flat group of the round
    before (its rewards all equal), so more of the step's groups teach something; the extra prompts are logged as
    ``curriculum/refilled``. Sync mode only."""

    def __post_init__(self) -> None:
        if self.window < 1 or self.min_tries < 1:
            raise ConfigError(f"curriculum.window and curriculum.min_tries must be >= 1, got {self.window} and "
                              f"{self.min_tries}")
        if len(self.band) != 2 or not 0 <= self.band[0] <= self.band[1] <= 1:
            raise ConfigError(f"curriculum.band must be [low, high] with 0 <= low <= high <= 1, got {list(self.band)}")
        if not 0 <= self.retry <= 1:
            raise ConfigError(f"curriculum.retry must be in [0, 1], got {self.retry}")
        if self.min_active < 0:
            raise ConfigError(f"curriculum.min_active must be >= 0, got {self.min_active}")
        if self.refill < 0:
            raise ConfigError(f"curriculum.refill must be >= 0, got {self.refill}")
        if isinstance(self.group_by, str):
            raise ConfigError(f"curriculum.group_by is a list of task fields: [{self.group_by}], not {self.group_by!r}")
        if self.min_tries > self.window:
            raise ConfigError(f"curriculum.min_tries ({self.min_tries}) cannot exceed curriculum.window "
                              f"({self.window}): a rate never has that many tries")


@dataclass
class DistillConfig:
    """On-policy distillation (``stages=[distill]``; trainer/distill.py): the policy samples on the env's tasks and
    learns each sampled token's log-probability under a teacher, alone or with the env's reward."""

    teacher: str | None = None
    """The teacher: an HF checkpoint dir, a run's output dir (its final weights), or the URL of a vLLM server
    (``http://host:port``) that returns prompt logprobs. It must share the policy's tokenizer."""
    teacher_model: str | None = None
    """The served model's name at a teacher URL (default: the server's only model)."""
    teacher_api_key: str | None = None
    """The key a teacher URL asks for (vLLM's ``--api-key``), sent as a bearer token. Keep it out of the command
    line: ``distill.teacher_api_key='${oc.env:TEACHER_API_KEY}'`` (the run's report shows it masked)."""
    kl_weight: float = 1.0
    """Weight of the teacher's signal: each sampled token's advantage gains ``kl_weight × (log p_teacher − log
    p_policy)``, so the update lowers the reverse KL(policy ‖ teacher) on the policy's own samples."""
    reward_weight: float = 0.0
    """Weight of the env reward's advantage (``algorithm.advantage``) added to every token's (0: the teacher alone)."""

    @property
    def served(self) -> bool:
        """Whether the teacher is a server's URL rather than a checkpoint."""
        return str(self.teacher).startswith(("http://", "https://"))

    def __post_init__(self) -> None:
        if self.kl_weight < 0 or self.reward_weight < 0 or self.kl_weight + self.reward_weight == 0:
            raise ConfigError(f"distill.kl_weight and distill.reward_weight must be >= 0 and not both 0, got "
                              f"{self.kl_weight} and {self.reward_weight}")
        if self.teacher_api_key and not self.served:
            raise ConfigError("distill.teacher_api_key is for a teacher URL; a checkpoint teacher needs none")


@dataclass
class InferenceConfig(EngineConfig):
    """The inference engine the rollouts use (shared with ``envkit eval``; see ``generators/engines/factory.py``)."""

    def __post_init__(self) -> None:
        _checked("inference", super().__post_init__)
        if self.api_key:
            raise ConfigError("inference.api_key is for engine=openai (chat mode), which cannot train; a served "
                              "model is reached without one")
        if self.engine == "openai":
            raise ConfigError("inference.engine=openai is chat mode, without the token ids and logprobs training "
                              "needs: use vllm, sglang or hf")


@dataclass
class JudgeSection(EngineConfig):
    """A judge server for the run's LLM judges: started and stopped with the run, its weights frozen, and published
    in ``ENVKIT_JUDGE_URL`` and ``ENVKIT_JUDGE_MODEL``, where a judge made with no endpoint calls it (an env's
    ``rubric=LLMJudge(...)``; see envkit/rewards/judges.py). Takes the engine options of ``inference``."""

    model: str | None = None
    """bundled, a checkpoint dir, policy (a frozen copy of the weights this stage starts from), or the served
    model's name for engine=openai (an external judge at ``url``); None (the default): no judge."""
    kv_cache_gib: int = 1

    def __post_init__(self) -> None:
        _checked("judge", super().__post_init__)
        if self.model is None and (self.url or self.api_key):
            raise ConfigError("judge.url and judge.api_key name a judge's endpoint: set judge.model too (bundled, a "
                              "checkpoint dir, policy, or the endpoint's model name)")
        if self.model is not None and self.engine == "hf":
            raise ConfigError("judge.engine=hf would run in the trainer's process, where envs cannot call it: use "
                              "vllm, sglang, or openai with judge.url")
        if self.api_key and self.engine != "openai":
            raise ConfigError("judge.api_key is for engine=openai (an external judge); a served judge needs none")


@dataclass
class WeightSyncSection(WeightSyncConfig):
    """How new weights reach the inference engine: mode, transport and swap (see
    ``generators/engines/weight_sync.py``)."""

    def __post_init__(self) -> None:
        _checked("weight_sync", super().__post_init__)


@dataclass
class TrainerConfig:
    """Optimization, backend, checkpoints and evaluation."""

    backend: str = "fsdp"
    """fsdp (FSDP2) or deepspeed (ZeRO)."""
    zero_stage: int = 2
    """DeepSpeed only: 2 or 3."""
    steps: int = 20
    """Training steps: each one generates, updates the policy and syncs the weights."""
    mode: str = "sync"
    """sync (generate, then train, in turn) or async (the next steps' rollouts are generated while a step trains,
    at most ``max_staleness`` weight versions behind: trainer/async_rollouts.py)."""
    max_staleness: int = 1
    """async: a group sampled more than this many versions before the policy it would train is dropped (0 trains
    exactly what sync mode trains)."""
    lr: float = 1e-5
    """Peak learning rate (AdamW)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    warmup_steps: int = 2
    """Optimizer steps of linear warm-up to ``lr``."""
    lr_schedule: str = "constant"
    """After warm-up: constant, or cosine (decays to a tenth of ``lr`` by the last step)."""
    grad_clip: float = 1.0
    """Gradient-norm clipping."""
    mini_batch_size: int = 0
    """Rollouts per optimizer step; 0 means the whole step's batch (one update per step, fully on-policy)."""
    epochs: int = 1
    """Passes over each step's batch."""
    micro_batch_tokens: int = 2048
    """Token budget of one forward/backward (gradient accumulation splits the mini-batch to fit)."""
    packing: bool = False
    """Pack sequences into one row per micro-batch instead of padding them. Pays off with a varlen attention kernel
    (``attention=flash_attention_2`` on GPU); eager and SDPA attend over the whole packed row, which costs more than
    the padding it saves."""
    share_prompt: bool = True
    """Rollouts of one prompt read it once per micro-batch: the prompt, then each rollout's rest, in one row whose
    attention mask lets each rollout see the prompt and itself (the same update, in fewer tokens: a group of n costs
    P + n·R instead of n·(P + R)). Not with packing, nor with flash_attention_2, which takes no such mask."""
    dtype: str = "auto"
    """Compute dtype over fp32 parameters: auto (bf16 on a GPU or a CPU with native bfloat16, else fp32), bf16, fp32."""
    attention: str = "auto"
    """transformers attention kernel: auto (sdpa; eager on CPU, except for RL with shared prompts), eager, sdpa,
    flash_attention_2."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward: less memory, more compute."""
    seed: int = 0
    """Seeds the task draws (and their shuffles), Python's and torch's RNGs."""
    output_dir: str = "runs/train"
    """Where metrics, checkpoints, weights, the reward curve and the report go."""
    save_every: int = 10
    """A checkpoint every k steps (and at the end)."""
    keep_last: int = 2
    """Checkpoints kept; older ones are deleted."""
    resume: str | None = None
    """null, ``latest`` (the newest checkpoint in output_dir), or a checkpoint dir."""
    eval_every: int = 0
    """Held-out evaluation every k steps (0: only before and after training)."""
    eval_tasks: int = 64
    """Held-out tasks per evaluation (0: no evaluation)."""
    eval_samples: int = 8
    """Samples per held-out task for the sampled accuracy."""
    eval_temperature: float = 1.0
    """Temperature of the sampled accuracy (the training temperature measures what GRPO optimizes)."""
    eval_greedy: bool = True
    """Also measure greedy accuracy (one sample per task at temperature 0)."""

    @property
    def shares_prompts(self) -> bool:
        """Whether RL micro-batches read each group's prompt once (``share_prompt``, where the layout allows it)."""
        return self.share_prompt and not self.packing and self.attention != "flash_attention_2"

    def __post_init__(self) -> None:
        _one_of("trainer.backend", self.backend, ("fsdp", "deepspeed"))
        _one_of("trainer.mode", self.mode, ("sync", "async"))
        _one_of("trainer.lr_schedule", self.lr_schedule, ("constant", "cosine"))
        _one_of("trainer.dtype", self.dtype, ("auto", "bf16", "fp32"))
        _one_of("trainer.attention", self.attention, ("auto", "eager", "sdpa", "flash_attention_2"))
        if self.zero_stage not in (2, 3):
            raise ConfigError(f"trainer.zero_stage must be 2 or 3, got {self.zero_stage}")
        for name in ("steps", "epochs", "micro_batch_tokens", "keep_last", "save_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"trainer.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_staleness < 0:
            raise ConfigError(f"trainer.max_staleness must be >= 0, got {self.max_staleness}")
        if self.lr <= 0:
            raise ConfigError(f"trainer.lr must be > 0, got {self.lr}")


@dataclass
class LoggingConfig:
    """Where metrics go."""

    tensorboard: bool = True
    """Write TensorBoard events into ``trainer.output_dir``."""
    wandb: bool = False
    """Also log to Weights & Biases (needs ``wandb`` installed)."""
    wandb_mode: str = "offline"
    """``WANDB_MODE`` when the environment sets none: offline, online or disabled."""
    wandb_project: str = "envkit"
    """The Weights & Biases project."""
    progress: bool = True
    """A progress bar on a terminal (elsewhere a line per step)."""
    rollouts: bool = False
    """Write every training step's rollouts, the ones it dropped (flat groups, failed rollouts) included, to
    ``trainer.output_dir/rollouts/step-N.jsonl``: what each step drew and how each group did."""
    traces: str | None = None
    """An OTLP/HTTP traces endpoint (``make traces`` serves Phoenix's, http://127.0.0.1:6006/v1/traces): one trace
    per rollout, across every process and node the run uses (docs/training/tracing.md). None: off."""


@dataclass
class OnlineConfig:
    """``stages=[online]``: serve the policy to clients, train on their traffic, promote what the gate passes
    (trainer/online.py; docs/serving.md)."""

    clients: str | None = None
    """The clients file (JSON: ``[{"name", "key", "capture"}]``, as ``envkit serve-policy --clients``); required."""
    host: str = "127.0.0.1"
    """The address clients call (0.0.0.0: every interface; the engines stay on loopback)."""
    port: int = 8000
    """The port clients call (0: a free one, printed)."""
    store: str | None = None
    """Where the calls and feedback are kept (default: ``trainer.output_dir/store``)."""
    sample_rate: float = 1.0
    """The share of consenting conversations stored."""
    redact: str | None = None
    """A redaction hook, ``module:attr``, run on each call before it is stored."""
    rubric: str | None = None
    """An envkit rubric, ``module:attr`` (an LLM judge, say), scoring stored calls in the background: the reward
    of conversations without feedback past ``deadline_s``, and the gate's score of replayed traffic."""
    max_concurrent: int = 64
    """Calls answered at once; past it, 429."""
    serving_cpu_cores: str = "auto"
    """vllm on CPU: the cores the serving engine computes on (``inference.cpu_cores`` is the candidate's). Two
    servers that both bind every core spin against each other: give each its own (on 2 cores: 0 and 1)."""
    rounds: int | None = None
    """How many rounds the stage trains (default: ``trainer.steps``; a run of several stages gives its online stage
    its own count here)."""
    round_episodes: int = 32
    """A round trains once this many conversations have their reward..."""
    round_s: float = 300.0
    """...or this long after the round before, with at least ``min_episodes``."""
    min_episodes: int = 8
    """The fewest conversations a round trains on once ``round_s`` has passed."""
    settle_s: float = 30.0
    """Feedback counts once its conversation has been quiet this long."""
    deadline_s: float = 120.0
    """A conversation no client scored this long after its last call takes the rubric's score (none: dropped)."""
    gate_tasks: int = 32
    """Held-out tasks of the env's eval split that each candidate and the serving policy are scored on."""
    gate_samples: int = 2
    """Samples per held-out task."""
    gate_replay: int = 32
    """Recent stored calls answered again by the candidate and scored by the rubric beside the served reply."""
    gate_margin: float = 0.02
    """How much worse than the serving policy a candidate may score and still be promoted (a candidate no better
    than it would fail a margin of 0 half the time by chance)."""
    gate_confidence: float = 0.95
    """The paired bootstrap's one-sided confidence: promoted if that lower bound of (candidate - serving) is at
    least ``-gate_margin``, on the held-out tasks and on the replay alike."""

    def __post_init__(self) -> None:
        for name in ("sample_rate",):
            if not 0 <= getattr(self, name) <= 1:
                raise ConfigError(f"online.{name} must be in [0, 1], got {getattr(self, name)}")
        if not 0.5 <= self.gate_confidence < 1:
            raise ConfigError(f"online.gate_confidence must be in [0.5, 1), got {self.gate_confidence}")
        for name in ("round_episodes", "min_episodes", "max_concurrent", "gate_samples"):
            if getattr(self, name) < 1:
                raise ConfigError(f"online.{name} must be >= 1, got {getattr(self, name)}")
        _checked("online.serving_cpu_cores", lambda: check_cpu_cores(self.serving_cpu_cores))
        if self.min_episodes > self.round_episodes:
            raise ConfigError(f"online.min_episodes ({self.min_episodes}) must be <= online.round_episodes "
                              f"({self.round_episodes})")
        if self.rounds is not None and self.rounds < 1:
            raise ConfigError(f"online.rounds must be >= 1, got {self.rounds}")


@dataclass
class PlacementConfig:
    """Where the run's processes live: all in this one (``local``; ``torchrun`` for more ranks), or as actors of a
    Ray cluster (``ray``): trainer ranks, inference replicas and env workers. See docs/training/multi-node.md."""

    backend: str = "local"
    """local or ray."""
    address: str | None = None
    """ray: the cluster to join (``auto``, ``HOST:6379``); unset starts a one-machine cluster for this run."""
    trainer_ranks: int = 1
    """ray: FSDP/DeepSpeed ranks, one actor each, forming one process group (gloo on CPU, NCCL on GPU)."""
    inference_replicas: int = 1
    """ray: inference servers, one actor each; rollouts are routed among them (generators/engines/replicas.py)."""
    env_workers: int = 0
    """ray: actors the envs run in (0: in rank 0's event loop, as with local)."""
    trainer_resources: dict[str, float] = field(default_factory=lambda: {"CPU": 1.0})
    """ray: per trainer rank (add ``GPU: 1`` on GPU nodes)."""
    trainer_threads: int = 0
    """ray: torch CPU threads per rank (0: the node's cores over the run's ranks). Ray would give a rank as many as
    its ``CPU`` resource, but the loop trains and generates in turn, so on CPU the update can have the cores."""
    replica_resources: dict[str, float] = field(default_factory=lambda: {"CPU": 1.0})
    """ray: per inference replica."""
    env_worker_resources: dict[str, float] = field(default_factory=lambda: {"CPU": 0.5})
    """ray: per env worker."""
    cluster_cpus: int = 0
    """ray without ``address``: logical CPUs of the cluster this run starts (0: enough for the actors above)."""

    def __post_init__(self) -> None:
        _one_of("placement.backend", self.backend, ("local", "ray"))
        if self.trainer_threads < 0:
            raise ConfigError(f"placement.trainer_threads must be >= 0, got {self.trainer_threads}")
        for name in ("trainer_ranks", "inference_replicas"):
            if getattr(self, name) < 1:
                raise ConfigError(f"placement.{name} must be >= 1, got {getattr(self, name)}")
        if self.env_workers < 0:
            raise ConfigError(f"placement.env_workers must be >= 0, got {self.env_workers}")
        if self.backend == "local" and (self.trainer_ranks, self.inference_replicas, self.env_workers) != (1, 1, 0):
            raise ConfigError("placement.trainer_ranks/inference_replicas/env_workers place Ray actors: set "
                              "placement.backend=ray (locally, more ranks come from torchrun)")


@dataclass
class SeatConfig:
    """Who plays one seat of a multi-agent env: exactly one of ``policy``, ``checkpoint``, ``script`` or
    ``endpoint``; with ``agent``, an agent that owns its loop plays it, calling the seat's policy or checkpoint."""

    policy: str | None = None
    """A policy this run trains, by name: each name is a model of its own (its optimizer, checkpoints, engine and
    metrics); seats naming one policy share it (self-play), each seat with its own baseline."""
    checkpoint: str | None = None
    """A frozen model: a checkpoint dir, or ``initial`` (the run's starting model), served by an engine of its own."""
    script: str | None = None
    """``module:attr`` naming a scripted player (:data:`generators.seats.Script`)."""
    endpoint: str | None = None
    """An OpenAI-compatible endpoint's base URL (chat mode), serving ``endpoint_model``."""
    endpoint_model: str = "policy"
    """The model name the endpoint serves."""
    agent: str | None = None
    """``module:attr`` naming an agent that owns its loop (an :data:`~envkit.agents.agent.Agent`: a callable, or a
    :class:`~envkit.agents.agent.Command`, run isolated): it plays the seat, run at each of its turns
    (:class:`generators.seats.AgentPlayer`), its model calls served by the seat's ``policy`` or ``checkpoint``
    through the capture gateway, whose recorded tokens a policy trains on."""

    def __post_init__(self) -> None:
        chosen = [k for k in ("policy", "checkpoint", "script", "endpoint") if getattr(self, k)]
        if len(chosen) != 1:
            raise ConfigError(f"a seat is played by exactly one of policy, checkpoint, script or endpoint; got "
                              f"{chosen or 'none'}")
        if self.agent and (self.script or self.endpoint):
            raise ConfigError(f"seat agent={self.agent!r} calls its seat's model through the capture gateway, which "
                              "records token ids: bind the seat to a policy or a checkpoint, not a "
                              f"{chosen[0]}")


@dataclass
class Config:
    """The whole run."""

    stages: list[str] = field(default_factory=lambda: ["rl"])
    """What the run does, in order, each stage from the weights the one before it left: ``[rl]`` (the default),
    ``[sft]``, ``[sft, rl]`` (supervised warm-up, then RL: ``+recipe=tool_agent``), ``[distill]`` (learn a
    teacher's tokens: ``distill.teacher``) or ``[online]``. With more than one stage each writes into
    ``trainer.output_dir/<stage>``."""
    env: EnvConfig = field(default_factory=EnvConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    generator: RolloutConfig = field(default_factory=RolloutConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    judge: JudgeSection = field(default_factory=JudgeSection)
    weight_sync: WeightSyncSection = field(default_factory=WeightSyncSection)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    online: OnlineConfig = field(default_factory=OnlineConfig)
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    seats: dict[str, SeatConfig] = field(default_factory=dict)
    """A multi-agent env's seats, each bound to its player (trainer/seated_run.py); empty for a single-agent env.
    The policies the seats name are trained together, one model each."""

    @property
    def policies(self) -> list[str]:
        """The policies the seats name, in seat order."""
        return list(dict.fromkeys(s.policy for s in self.seats.values() if s.policy))

    @property
    def engines(self) -> int:
        """Inference engines the run starts: one; with seats, one per policy and per frozen checkpoint (the starting
        model's too where the run evaluates), or one server of them all (:attr:`lora_adapters`)."""
        if not self.seats:
            return 1
        frozen = {s.checkpoint for s in self.seats.values() if s.checkpoint} | ({"initial"} if self.trainer.eval_tasks
                                                                               else set())
        if self.lora_adapters:
            return 1 + len(frozen - {"initial"})
        return len(self.policies) + len(frozen)

    @property
    def lora_adapters(self) -> bool:
        """Whether one vLLM server serves the policies as LoRA adapters beside the base model (``model.lora.serve``)."""
        lora = self.model.lora
        if not lora.enabled or lora.serve != "auto":
            return lora.enabled and lora.serve == "adapters"
        from generators.engines.vllm import is_cpu_build  # the openai SDK with it: half a second, for LoRA runs only

        return (len(self.policies) > 1 and self.inference.engine == "vllm" and self.weight_sync.mode != "memory"
                and not self.model.policy_paths and "sft" not in self.stages and not is_cpu_build())

    @property
    def mini_batch_size(self) -> int:
        """Rollouts per optimizer step (``trainer.mini_batch_size`` or the whole batch)."""
        return self.trainer.mini_batch_size or self.generator.batch_size

    @property
    def trains_on_rollouts(self) -> bool:
        """Whether a stage of the run trains on groups of rollouts (rl, distill: the sft stage has no rollout batch)."""
        return bool({"rl", "distill"} & set(self.stages))

    def __post_init__(self) -> None:
        if not self.stages or len(set(self.stages)) < len(self.stages):
            raise ConfigError(f"stages must list each stage once, in order, e.g. [sft, rl]; got {list(self.stages)}")
        for stage in self.stages:
            _one_of("stages", stage, STAGES)
        if self.trains_on_rollouts:
            self._check_batch()
        _checked("weight_sync", lambda: self.weight_sync.check_engine(self.inference.engine))
        _checked("weight_sync", lambda: self.weight_sync.check_placement(self.placement.backend))
        for refusal in REFUSED:
            if refusal.applies(self):
                raise ConfigError(refusal.message)
        if self.algorithm.aggregation == "seq-mean-token-sum-norm" and self.generator.max_total_tokens < 1:
            raise ConfigError("seq-mean-token-sum-norm normalizes by generator.max_total_tokens, which must be >= 1")

    def _check_batch(self) -> None:
        """The rollout batch splits into mini-batches, and a group-relative advantage has a group to compare."""
        batch = self.generator.batch_size
        if self.mini_batch_size > batch or batch % self.mini_batch_size:
            raise ConfigError(
                f"trainer.mini_batch_size={self.mini_batch_size} must divide the rollout batch "
                f"(generator.prompts_per_step × generator.samples_per_prompt = {self.generator.prompts_per_step} × "
                f"{self.generator.samples_per_prompt} = {batch})"
            )
        if self.algorithm.advantage in ("grpo", "dr_grpo", "rloo") and self.generator.samples_per_prompt < 2:
            raise ConfigError(f"algorithm.advantage={self.algorithm.advantage} compares samples of one prompt: "
                              "set generator.samples_per_prompt >= 2")

    @property
    def steps_per_update(self) -> int:
        """Optimizer steps per training step."""
        return self.trainer.epochs * self.generator.batch_size // self.mini_batch_size


@dataclass(frozen=True)
class Refusal:
    """A combination of settings that no run takes, and why: one row of :data:`REFUSED`."""

    when: str
    """The combination, as a user writes it."""
    why: str
    """Why it cannot run, and what to do instead."""
    applies: Callable[[Config], bool]
    """Whether a config holds the combination."""
    unbuilt: bool = False
    """Whether it could work and is only not built yet (else it cannot work as asked)."""

    @property
    def message(self) -> str:
        """The config error a run that holds it fails with."""
        return f"{self.when}: {self.why}"


def _online(cfg: Config) -> bool:
    return "online" in cfg.stages


def _distill(cfg: Config) -> bool:
    return "distill" in cfg.stages


def _adapters(cfg: Config) -> bool:
    return cfg.model.lora.serve == "adapters"


REFUSED: tuple[Refusal, ...] = (
    Refusal("several stages with trainer.resume=DIR",
            "trainer.resume names one checkpoint, but each stage has its own: resume with trainer.resume=latest",
            lambda c: len(c.stages) > 1 and c.trainer.resume not in (None, "latest")),
    Refusal("placement.backend=ray with inference.url and placement.inference_replicas > 1",
            "inference.url is the one server a run attaches to; placement.inference_replicas counts the servers a Ray "
            "run starts of its own: drop one of them",
            lambda c: c.placement.backend == "ray" and bool(c.inference.url) and c.placement.inference_replicas > 1),
    Refusal("curriculum.refill with trainer.mode=async",
            "curriculum.refill draws again within a step: it needs trainer.mode=sync (async mode fills its steps "
            "from groups generated ahead)",
            lambda c: bool(c.curriculum.refill) and c.trainer.mode != "sync"),
    Refusal("stages=[online] without online.clients", "the online stage needs online.clients (the clients file)",
            lambda c: _online(c) and c.online.clients is None),
    Refusal("stages=[online] with placement.backend=ray",
            "the online stage needs placement.backend=local, one rank: it serves one policy from this machine",
            lambda c: _online(c) and c.placement.backend != "local", unbuilt=True),
    Refusal("stages=[online] with inference.url",
            "the online stage needs engines it starts (no inference.url): one serves, the other holds the candidate",
            lambda c: _online(c) and bool(c.inference.url)),
    Refusal("stages=[distill] without distill.teacher",
            "the distill stage needs distill.teacher (a checkpoint dir, a run's output dir or a vLLM server's URL)",
            lambda c: _distill(c) and not c.distill.teacher),
    Refusal("a distill.teacher URL with generator.temperature other than 1",
            "the distill stage needs generator.temperature=1 with a teacher URL: a server's prompt logprobs are at "
            "temperature 1",
            lambda c: _distill(c) and c.distill.served and c.generator.temperature != 1.0),
    Refusal("stages=[distill] with algorithm.advantage=gae",
            "the distill stage needs algorithm.advantage other than gae (the teacher's signal is the per-token "
            "advantage)",
            lambda c: _distill(c) and c.algorithm.critic),
    Refusal("seats without a policy", "seats: a run of several policies needs a seat that names a policy to "
            "train: bind one with seats.SEAT.policy=NAME", lambda c: bool(c.seats) and not c.policies),
    Refusal("seats with the online stage",
            "seats: the online stage serves one policy to its clients; a run with seats trains several together",
            lambda c: bool(c.seats) and "online" in c.stages),
    Refusal("seats with an sft stage without sft.policy",
            "seats: the sft stage trains one policy on its seats' demonstrations: name it with sft.policy=NAME",
            lambda c: bool(c.seats) and "sft" in c.stages and c.sft.policy not in c.policies),
    Refusal("seats with sft.data=demos",
            "seats: a multi-agent env's demonstrations are not one seat's: give the seat's demonstrations as "
            "sft.data=chat or trajectories with sft.paths",
            lambda c: bool(c.seats) and "sft" in c.stages and c.sft.data == "demos"),
    Refusal("seats with inference.url",
            "seats: a run of several policies needs no inference.url: each policy needs an engine of its own",
            lambda c: bool(c.seats) and bool(c.inference.url)),
    Refusal("model.lora.serve=adapters with model.lora.r=0", "model.lora.serve=adapters needs model.lora.r > 0",
            lambda c: _adapters(c) and not c.model.lora.enabled),
    Refusal("model.lora.serve=adapters without seats",
            "model.lora.serve=adapters needs a run with seats (a single policy's adapters are served merged: "
            "model.lora.serve=merged)", lambda c: _adapters(c) and not c.seats),
    Refusal("model.lora.serve=adapters with inference.engine other than vllm",
            "model.lora.serve=adapters needs inference.engine=vllm",
            lambda c: _adapters(c) and c.inference.engine != "vllm"),
    Refusal("model.lora.serve=adapters with model.policy_paths (or an sft stage with seats)",
            "model.lora.serve=adapters serves every policy as an adapter of model.path: a policy that starts from "
            "other weights is not one (use model.lora.serve=merged)",
            lambda c: _adapters(c) and (bool(c.model.policy_paths) or "sft" in c.stages)),
    Refusal("model.lora.serve=adapters with weight_sync.mode=memory",
            "model.lora.serve=adapters needs weight_sync.mode=auto or disk: an adapter goes to the server as a file",
            lambda c: _adapters(c) and c.weight_sync.mode == "memory"),
)
"""Every combination of settings a run refuses, checked in order after each section's own values: the
configuration reference lists them (docs/gen/reference.py)."""


def _checked(section: str, check: Callable[[], None]) -> None:
    """Run a check shared with envkit eval, its ValueError becoming a ConfigError that names the section."""
    try:
        check()
    except ValueError as e:
        raise ConfigError(f"{section}.{e}") from None


def _one_of(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{name}={value!r} is not one of: {', '.join(allowed)}")


def register_configs() -> None:
    """Register the schema with Hydra's ConfigStore (the YAML files in trainer/conf extend it)."""
    ConfigStore.instance().store(name="schema", node=Config)
