"""On-policy distillation (``stages=[distill]``): the RL loop (trainer/loop.py) following a teacher's signal, its
:class:`~trainer.objective.Objective` a :class:`DistillObjective`. Each step:

    trajs   = the policy's rollouts on the env's tasks, as in RL; flat groups are kept (the teacher grades every
              token, whatever the env's reward)
    teacher = log p_teacher(token | all before it) for every model token: a forward pass of the teacher here, or a
              vLLM server's prompt logprobs. The teacher reads exactly the policy's context, env turns and tool
              results included.
    A_token = distill.kl_weight · (log p_teacher − log p_policy) + distill.reward_weight · A_env
    loss    = RL's policy loss on those per-token advantages (``algorithm.policy_loss``)

``log p_policy`` is the sampler's logprob of the token it drew, so ``log p_policy − log p_teacher`` is a one-sample
estimate of the reverse KL(policy ‖ teacher) at that token (logged as ``distill/teacher_kl``), and the policy
gradient on the advantage above lowers it on the states the policy itself visits (GKD, Agarwal et al. 2024;
"on-policy distillation", Thinking Machines 2025). A teacher must share the policy's tokenizer: its logprobs are of
the policy's token ids, read in the policy's chat template; :func:`check_tokenizers` refuses any other at start.
"""

from __future__ import annotations

import asyncio
import json
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import httpx
import torch

from generators import ChatTokenizer, Trajectory
from generators.models import resolve_model
from trainer.backends import train_dtype
from trainer.backends.base import BackendConfig, Batch
from trainer.backends.common import load_model, model_logprobs
from trainer.batching import StepBatch, micro_batches, stack_rows
from trainer.config import Config, ConfigError, DistillConfig
from trainer.distributed import broadcast_from_rank0
from trainer.loop import train
from trainer.objective import Objective
from trainer.placement.base import RunFailed
from trainer.runs import Run

PROBE = [{"role": "system", "content": "You are terse."},
         {"role": "user", "content": "What is 12 + 7? Ünïcödé, 数字 and\ttabs."},
         {"role": "assistant", "content": "The answer is 19."},
         {"role": "user", "content": "Now add 3."}]
"""A chat the policy's and a served teacher's templates must render to the same ids."""


class Teacher(ABC):
    """Scores the policy's tokens: ``logprobs`` gives, per sequence, a (prompt + response,) tensor with the
    teacher's logprob of each model token at its position and 0.0 elsewhere (the rows of ``trainer/batching.py``)."""

    @abstractmethod
    def logprobs(self, trajectories: list[Trajectory]) -> dict[int, torch.Tensor]:
        """The teacher's logprobs of each sequence's model tokens, keyed by its index."""


class ReceivedTeacher(Teacher):
    """The teacher of the ranks above 0: it scores nothing, and rank 0's teacher's logprobs reach them by
    broadcast (:meth:`DistillObjective.score`)."""

    def logprobs(self, trajectories: list[Trajectory]) -> dict[int, torch.Tensor]:
        return {}


class LocalTeacher(Teacher):
    """A checkpoint loaded here, frozen, and run on the policy's tokens, micro-batched like the update. It computes
    in the policy's compute dtype: bf16 weights cost a third of fp32's time on a CPU, and the sampler's logprobs it
    is compared with are bf16's anyway."""

    def __init__(self, path: str, *, temperature: float, pad_id: int, budget: int,
                 dtype: torch.dtype = torch.float32) -> None:
        self.device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        self.model = load_model(BackendConfig(model_path=path), self.device).to(self.device, dtype).eval()
        self.model.requires_grad_(False)
        self.temperature, self.pad_id, self.budget = temperature, pad_id, budget

    @torch.no_grad()
    def logprobs(self, trajectories: list[Trajectory]) -> dict[int, torch.Tensor]:
        out: dict[int, torch.Tensor] = {}
        for mb, rows in micro_batches(list(range(len(trajectories))), trajectories, budget=self.budget,
                                      packing=False, pad_id=self.pad_id):
            logprobs = model_logprobs(self.model, mb, self.device, self.temperature).logprobs.float().cpu()
            for row, i in enumerate(rows):
                out[i] = logprobs[row, :len(trajectories[i].prompt_ids) + len(trajectories[i].response_ids)]
        return out


class ServedTeacher(Teacher):
    """A vLLM server's prompt logprobs (``/v1/completions`` with ``prompt_logprobs``: vLLM's extension, the
    OpenAI API has none) of each sequence's whole token ids. Whatever it answers is checked: a server that fails, or
    answers anything but a log-probability (at most 0) of each of the policy's tokens, ends the run with
    :class:`RunFailed` naming what it sent, and the run resumes from its last checkpoint."""

    def __init__(self, url: str, model: str | None, *, api_key: str | None = None, concurrency: int = 16,
                 timeout_s: float = 300.0) -> None:
        self.url, self.concurrency, self.timeout_s = url.rstrip("/").removesuffix("/v1"), concurrency, timeout_s
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.model = model or self._only_model()

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        """A start-up request's JSON; an unreachable or refusing server is a ConfigError."""
        try:
            response = httpx.request(method, f"{self.url}{path}", headers=self.headers, timeout=30, **kwargs)
        except httpx.HTTPError as e:
            raise ConfigError(f"distill.teacher={self.url} cannot be reached ({type(e).__name__}: {e})") from None
        if response.status_code != 200:
            hint = ": set distill.teacher_api_key" if response.status_code == 401 and not self.headers else ""
            raise ConfigError(f"distill.teacher={self.url} answered {response.status_code} to {path}{hint} "
                              f"({response.text[:200]})")
        try:
            return response.json()
        except ValueError:
            raise ConfigError(f"distill.teacher={self.url} answered {path} with no JSON: {response.text[:200]!r}") \
                from None

    def _only_model(self) -> str:
        try:
            models = [m["id"] for m in self._request("GET", "/v1/models")["data"]]
        except (KeyError, TypeError) as e:
            raise ConfigError(f"distill.teacher={self.url}: /v1/models lists no models ({e!r})") from None
        if len(models) != 1:
            raise ConfigError(f"distill.teacher={self.url} serves {models}: name one with distill.teacher_model")
        return models[0]

    def tokenize(self, **request: Any) -> list[int]:
        """The server's token ids for a ``/tokenize`` request (``prompt=`` or ``messages=``)."""
        answer = self._request("POST", "/tokenize", json={"model": self.model, **request})
        if not isinstance(answer, dict) or not isinstance(answer.get("tokens"), list):
            raise ConfigError(f"distill.teacher={self.url} did not tokenize ({str(answer)[:200]}): its tokenizer "
                              "cannot be checked against the policy's")
        return list(answer["tokens"])

    def logprobs(self, trajectories: list[Trajectory]) -> dict[int, torch.Tensor]:
        # A loop of its own, never made the thread's current one: the run's runner keeps its own.
        loop = asyncio.new_event_loop()
        try:
            return loop.run_until_complete(self._all(trajectories))
        finally:
            loop.close()

    async def _all(self, trajectories: list[Trajectory]) -> dict[int, torch.Tensor]:
        limit = asyncio.Semaphore(self.concurrency)
        transport = httpx.AsyncHTTPTransport(retries=3)  # a refused connection is tried again; an answer is not
        async with httpx.AsyncClient(timeout=self.timeout_s, headers=self.headers, transport=transport) as client:
            async def one(t: Trajectory) -> torch.Tensor:
                async with limit:
                    return await self._one(client, t)

            scored = await asyncio.gather(*(one(t) for t in trajectories))
        return dict(enumerate(scored))

    async def _one(self, client: httpx.AsyncClient, t: Trajectory) -> torch.Tensor:
        ids = t.prompt_ids + t.response_ids
        try:
            response = await client.post(f"{self.url}/v1/completions", json={
                "model": self.model, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0})
        except httpx.HTTPError as e:
            raise self._failed(f"cannot be reached: {type(e).__name__}: {e}") from None
        if response.status_code != 200:
            raise self._failed(f"answered {response.status_code} to /v1/completions: {response.text[:300]}")
        out = torch.zeros(len(ids))
        start = len(t.prompt_ids)
        try:
            entries = response.json()["choices"][0]["prompt_logprobs"]  # None for the first token, then one per token
            for position, (token, mask) in enumerate(zip(t.response_ids, t.loss_mask, strict=True), start):
                if mask:
                    out[position] = float(entries[position][str(token)]["logprob"])
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise self._failed(f"did not return a prompt logprob for each of the policy's {len(ids)} tokens "
                               f"({type(e).__name__}: {e}): {response.text[:300]}") from None
        if not bool(torch.all(out <= 0)):  # NaN and +inf fail too: an advantage the update would follow anywhere
            wrong = out[out.isnan() | (out > 0)][:5].tolist()
            raise self._failed(f"answered log-probabilities that are not <= 0: {wrong}")
        return out

    def _failed(self, what: str) -> RunFailed:
        return RunFailed(f"the teacher at {self.url} {what}. The run's checkpoints are intact: once the teacher "
                         "answers, rerun with trainer.resume=latest")


def teacher_checkpoint(spec: str) -> str:
    """The checkpoint dir ``distill.teacher`` names: a checkpoint dir, or a run's output dir (the final weights its
    ``summary.json`` names, else its newest ``weights/vN``)."""
    path = Path(spec).expanduser()
    if (path / "config.json").is_file() or not path.is_dir():
        try:
            return resolve_model(spec)
        except FileNotFoundError as e:
            raise ConfigError(f"distill.teacher: {e}") from None
    summary = path / "summary.json"
    weights = json.loads(summary.read_text()).get("weights") if summary.is_file() else None
    if weights and (Path(weights) / "config.json").is_file():
        return str(Path(weights).resolve())
    versions = [v for v in path.glob("weights/v*") if v.name[1:].isdigit() and (v / "config.json").is_file()]
    if versions:
        return str(max(versions, key=lambda v: int(v.name[1:])).resolve())
    raise ConfigError(f"distill.teacher={spec} is neither a checkpoint dir (config.json) nor a run's output dir with "
                      "final weights (summary.json, or weights/vN)")


def check_tokenizers(policy: ChatTokenizer, teacher: ChatTokenizer, name: str) -> None:
    """Refuse a teacher whose vocabulary, special tokens or chat template differ from the policy's."""
    differences = []
    ours, theirs = policy.tokenizer.get_vocab(), teacher.tokenizer.get_vocab()
    if ours != theirs:
        differing = len(set(ours.items()) ^ set(theirs.items()))
        differences.append(f"vocabularies differ ({len(ours)} vs {len(theirs)} tokens, {differing} token-id pairs "
                           f"in one only: {policy.fingerprint} vs {teacher.fingerprint})")
    specials = {"eos": (policy.eos_id, teacher.eos_id), "pad": (policy.pad_id, teacher.pad_id),
                "bos": (policy.tokenizer.bos_token_id, teacher.tokenizer.bos_token_id),
                "special tokens": (sorted(policy.tokenizer.all_special_tokens),
                                   sorted(teacher.tokenizer.all_special_tokens))}
    differences += [f"{what}: {a} vs {b}" for what, (a, b) in specials.items() if a != b]
    if policy.template != teacher.template:
        differences.append("chat templates differ (the teacher would read the policy's context in another format)")
    _refuse(differences, name)


def check_served_tokenizer(policy: ChatTokenizer, teacher: ServedTeacher) -> None:
    """Refuse a served teacher that renders a probe chat, or encodes text, to other ids than the policy."""
    differences = []
    if teacher.tokenize(messages=PROBE, add_generation_prompt=True) != policy.render(PROBE):
        differences.append("its chat template renders a probe chat to other token ids")
    text = " ".join([PROBE[1]["content"], *policy.tokenizer.all_special_tokens])
    ours = policy.tokenizer.encode(text, add_special_tokens=False)
    if teacher.tokenize(prompt=text, add_special_tokens=False) != ours:
        differences.append("it encodes a probe text (with every special token) to other token ids")
    _refuse(differences, teacher.url)


def _refuse(differences: list[str], name: str) -> None:
    if differences:
        raise ConfigError(f"distill.teacher={name} does not share the policy's tokenizer: "
                          + "; ".join(differences) + ". Its logprobs would score other tokens than the policy "
                          "sampled: distill from a teacher with the same tokenizer and chat template")


def open_teacher(cfg: Config, policy: ChatTokenizer) -> Teacher:
    """The run's teacher (``cfg.distill.teacher``), its tokenizer checked against the policy's."""
    spec = str(cfg.distill.teacher)
    if cfg.distill.served:
        served = ServedTeacher(spec, cfg.distill.teacher_model, api_key=cfg.distill.teacher_api_key)
        check_served_tokenizer(policy, served)
        return served
    path = teacher_checkpoint(spec)
    check_tokenizers(policy, ChatTokenizer.from_pretrained(path), spec)
    dtype = torch.bfloat16 if train_dtype(cfg.trainer.dtype) == "bf16" else torch.float32
    return LocalTeacher(path, temperature=cfg.generator.temperature, pad_id=policy.pad_id,
                        budget=cfg.trainer.micro_batch_tokens, dtype=dtype)


def token_advantages(env: torch.Tensor, teacher: torch.Tensor, policy: torch.Tensor, mask: torch.Tensor,
                     distill: DistillConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token advantages (B, T) from the env's advantages and both models' logprobs of the sampled tokens, and
    the per-token reverse KL estimate ``log p_policy − log p_teacher`` (0 off the mask)."""
    kl = (policy - teacher) * mask  # (B, T)
    return distill.reward_weight * env - distill.kl_weight * kl, kl


class DistillObjective(Objective):
    """The update follows ``distill.kl_weight`` times the teacher's per-token signal plus ``distill.reward_weight``
    times the env's advantages (:func:`token_advantages`)."""

    stage = "distill"
    keeps_flat_groups = True  # the teacher grades every token, whatever the env's reward

    def __init__(self, teacher: Teacher, cfg: DistillConfig) -> None:
        self.teacher, self.cfg = teacher, cfg
        self.scores: dict[int, torch.Tensor] = {}
        """The teacher's logprobs of the batch being trained on, per sequence."""

    def score(self, batch: StepBatch) -> dict[str, float]:
        t0 = time.perf_counter()
        self.scores = broadcast_from_rank0(self.teacher.logprobs(batch.trajectories))  # rank 0 holds the teacher
        return {"time/teacher_s": time.perf_counter() - t0}

    def token_advantages(self, advantages: torch.Tensor, rows: list[int], mb: Batch
                         ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        teacher = stack_rows(self.scores, rows, advantages.shape)
        mixed, kl = token_advantages(advantages, teacher, mb["rollout_logprobs"], mb["loss_mask"], self.cfg)
        return mixed, {"distill/teacher_kl": kl}


def train_distill(cfg: Config, *, evaluate_before: bool = True) -> dict[str, Any]:
    """The distill stage: the RL loop learning from ``cfg.distill.teacher``, opened (and its tokenizer checked) on
    rank 0 before anything starts."""
    def objective(run: Run) -> DistillObjective:
        return DistillObjective(run.on_main(lambda: open_teacher(cfg, run.tokenizer), ReceivedTeacher()), cfg.distill)

    return train(cfg, evaluate_before=evaluate_before, objective=objective)
