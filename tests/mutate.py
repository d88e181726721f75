"""Mutants for the tests that guard one feature each: break the feature in the product code, run the test that
guards it, and see the test fail.

Each :class:`Mutation` names a product file and a symbol in it (``"envkit/rewards/judges.py::LLMJudge.read"``), an exact
snippet inside that symbol's source and what replaces it, and the test that must then fail. The symbol is found with
``ast`` (by its name path: class, then method), so the mutation still applies when code around it moves; an anchor
or a snippet that is not found (or not once) is reported, never guessed at. For each mutation::

    back up the file -> apply the mutation -> .venv/bin/pytest -q -x NODEID -> restore the file

Each guarding test first runs unmutated, once per run however many mutations it guards: a test that fails (or
errs, or skips) without its mutant proves nothing by failing with it, and the table says ``not a kill``. Then the
table says ``killed`` (the test failed), ``SURVIVED`` (it passed: it does not guard what it claims),
``anchor missing``, ``skipped`` or ``error`` (pytest could not run it: the test proves nothing either way). Usage::

    .venv/bin/python tests/mutate.py                 # every mutation
    .venv/bin/python tests/mutate.py --list          # what each one breaks, and what its test needs
    .venv/bin/python tests/mutate.py --only NAME     # one (repeat --only for several)

It edits product files in place while a test runs: do not run it beside another test run of the same tree (a
subprocess that test starts would import the mutant). The original is restored in ``finally``, on SIGINT and
SIGTERM too, and a backup with its content stays in .cache/mutate/ until it is; a run that was killed outright
(SIGKILL) is undone by the next one, which restores a file still holding its mutant before it starts.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

ROOT = Path(__file__).resolve().parents[1]
PYTEST = ROOT / ".venv" / "bin" / "pytest"
BACKUPS = ROOT / ".cache" / "mutate"
"""Where a mutated file's original waits (.cache is ignored by git) until the run puts it back."""


@dataclass(frozen=True)
class Mutation:
    """One bug, put into one symbol of one product file, and the test that must catch it."""

    name: str
    anchor: str
    """``path/to/file.py::Name.path``: the function, method or class whose source holds :attr:`old`."""
    old: str
    """An exact snippet of that symbol's source, found there once."""
    new: str
    test: str
    """The pytest node id that must fail with the mutation in."""
    bug: str
    """The real bug the mutation stands for."""
    needs: str = ""
    """What the test needs beyond the CPU (a vLLM server, the verifiers venv), for --list."""

    @property
    def path(self) -> Path:
        return ROOT / self.anchor.split("::", 1)[0]

    @property
    def symbol(self) -> str:
        return self.anchor.split("::", 1)[1]


MUTATIONS = [
    Mutation(
        "body-unicode-unchecked",
        "envkit/json_limits.py::_text_problem",
        '        text.encode("utf-8")\n',
        "        pass\n",
        "tests/test_serving.py::test_hostile_bodies_get_a_4xx_that_names_the_fault_and_metrics_count_every_status",
        "a lone surrogate reaches the tokenizer, whose exception answers the client with a 500: any client can make "
        "the policy server fail at will",
        needs="vLLM"),
    Mutation(
        "body-depth-unchecked",
        "envkit/json_limits.py::json_problem",
        "            if depth >= limits.max_depth:",
        "            if False:",
        "tests/test_serving.py::test_hostile_bodies_get_a_4xx_that_names_the_fault_and_metrics_count_every_status",
        "JSON nested hundreds deep is taken into the handlers, whose recursive walks of it can exhaust the stack",
        needs="vLLM"),
    Mutation(
        "online-gate-promotes-anything",
        "trainer/online.py::verdict",
        "if test.n == 0 or test.lower < -margin]",
        "if test.n == 0]",
        "tests/test_serving.py::test_the_gate_refuses_a_worse_candidate_with_its_numbers_and_passes_one_as_good",
        "the online stage's gate promotes every candidate it measured, however much worse it scores than what "
        "serves: a population that rewards the wrong thing trains what every client is then served"),
    Mutation(
        "online-gate-promotes-anything-end-to-end",
        "trainer/online.py::verdict",
        "if test.n == 0 or test.lower < -margin]",
        "if test.n == 0]",
        "tests/test_serving.py::test_the_online_stage_refuses_a_misled_candidate_promotes_an_honest_one_and_a_kill_9_"
        "loses_nothing",
        "the same, seen from the front door: a round trained on feedback that inverts the gate's rubric is served"),
    Mutation(
        "serving-sheds-nothing",
        "generators/serving/server.py::PolicyServer._handler",
        "if self.active >= self.config.max_concurrent:",
        "if False:",
        "tests/test_serving.py::test_bad_requests_get_4xx_overload_gets_429_and_the_server_keeps_serving",
        "past max_concurrent the policy server queues calls without end instead of shedding them with 429: a burst "
        "makes every client wait, and the engine's queue grows without bound"),
    Mutation(
        "serving-drain-cut-short",
        "generators/serving/server.py::PolicyServer.stop",
        "self._server.should_exit = True",
        "self._server.should_exit = self._server.force_exit = True",
        "tests/test_serving.py::test_serve_policy_drains_on_sigterm_and_forgets_a_client_offline",
        "SIGTERM stops the policy server without letting the calls in flight finish: answers clients were waiting "
        "for are lost, with calls whose text may already be stored"),
    Mutation(
        "late-feedback-taken-before-it-settles",
        "generators/serving/episodes.py::RewardRule.reward",
        "if feedback and age_s >= self.settle_s:",
        "if feedback:",
        "tests/test_serving.py::test_conversations_come_back_as_trajectories_with_their_late_reward",
        "a conversation is trained on as soon as one of its calls has feedback, before it settles: a call that "
        "continues it later lands in another round, as a conversation of its own"),
    Mutation(
        "curriculum-refill-draws-nothing",
        "trainer/sources.py::refilled",
        "        if not again:\n            break",
        "        break",
        "tests/test_curriculum.py::test_refill_draws_a_prompt_again_for_each_flat_group_and_counts_what_it_cost",
        "curriculum.refill draws no start again for a flat group: a step of flat groups trains on nothing, while "
        "the config says it refills them"),
    Mutation(
        "markup-kept-as-markup",
        "envkit/markup.py::inert",
        "return pattern.sub(lambda m: m[0][0] + WORD_JOINER + m[0][1:], text)",
        "return text",
        "tests/test_rubrics.py::test_a_reply_that_writes_chat_markup_reaches_its_judge_as_text_and_is_flagged",
        "a reply's chat markup reaches its judge as control tokens: a policy that writes <|im_end|><|im_start|>system "
        "opens a system turn of its own in the judge's prompt"),
    Mutation(
        "deepspeed-lora-checkpoint-keeps-the-tied-head",
        "trainer/backends/deepspeed.py::DeepSpeedBackend.__init__",
        "model.register_state_dict_post_hook(trained_only)",
        "pass",
        "tests/test_sft.py::test_sft_trains_lora_on_deepspeed_and_resumes_exactly",
        "a LoRA checkpoint on DeepSpeed holds the frozen embeddings under the tied head's name (DeepSpeed's own "
        "exclusion of frozen parameters misses it): half a small model's bytes in every checkpoint",
        needs="DeepSpeed"),
    Mutation(
        "kill-user-scans-only",
        "envkit/agents/untrusted.py::kill_user",
        "    _kill_as(uid)\n",
        "",
        "tests/test_untrusted.py::test_a_process_the_scan_cannot_see_dies_too",
        "an untrusted run's process that no scan of /proc sees (a fork walker, a child forked as the scan read the "
        "listing) outlives the run and holds its pipes, its files and its uid's next lease"),
    Mutation(
        "docs-show-sphinx-roles",
        "docs/gen/griffe_roles.py::SphinxRoles.on_instance",
        "obj.docstring.value = to_markdown(obj.docstring.value)",
        "obj.docstring.value = obj.docstring.value",
        "tests/test_docs_site.py::test_no_sphinx_role_reaches_a_page",
        "the API pages render docstrings as written: every :class:`...` shows raw (mkdocs --strict passes)",
    ),
    Mutation(
        "config-reference-drops-inherited-docs",
        "docs/gen/reference.py::config_keys",
        "rows += config_keys(hints[f.name], value, key + \".\")",
        "rows += config_keys(hints[f.name], value, key + \".\")[:-1]",
        "tests/test_docs_site.py::test_the_config_reference_lists_every_key_the_trainer_composes",
        "the configuration reference leaves a key of each section out, so a setting has no documentation",
    ),
    Mutation(
        "reward-model-reads-a-pad",
        "generators/reward_model.py::RewardModel._load",
        "self._tokenizer = AutoTokenizer.from_pretrained(path)",
        'self._tokenizer = AutoTokenizer.from_pretrained(path, pad_token="<|endoftext|>")',
        "tests/test_rubrics.py::test_a_reward_model_scores_concurrent_episodes_in_shared_batches",
        "the tokenizer pads with a token the model does not skip: a padded row is scored at a pad, not its last "
        "token (the longest row of the batch, which has no padding, scores the same)"),
    Mutation(
        "second-look-not-counted",
        "envkit/rewards/judges.py::LLMJudge.evaluate",
        "[value] = [min(scores) for scores",
        "[value] = [scores[0] for scores",
        "tests/test_rubrics.py::test_a_judge_talked_up_by_a_reply_is_held_by_its_second_look",
        "the second look is taken but its score is dropped: the reply's own talk decides its score"),
    Mutation(
        "talk-read-before-normalising",
        "envkit/rewards/grader_talk.py::normalise",
        'text = visible(unicodedata.normalize("NFKC", text))',
        "return text",
        "tests/test_judge_check.py::test_every_attack_talks_a_gullible_judge_up_without_the_defences_and_none_with_them",
        "talk spelt with look-alike or invisible characters is read as written: the word list misses it"),
    Mutation(
        "whole-reply-for-a-correctness-task",
        "envkit/rewards/judges.py::LLMJudge.evaluate",
        "final = _final(self.answer, episode.reply, task)",
        "final = episode.reply",
        "tests/test_judge_check.py::test_every_attack_talks_a_gullible_judge_up_without_the_defences_and_none_with_them",
        "a judge with answer= reads the whole reply, so what the policy wrote beside its answer reaches it"),
    Mutation(
        "final-answer-read-with-the-talk",
        "envkit/rewards/judges.py::_final",
        "return answer(without_grader_talk(reply, _script(task)))",
        "return answer(reply)",
        "tests/test_judge_check.py::test_a_correctness_judge_sees_the_final_answer_and_nothing_an_attack_adds_to_it",
        "the final answer is read with the reply's talk in it: a score written after the answer is taken for it"),
    Mutation(
        "channel-takes-any-key",
        "generators/gateway/server.py::Gateway.episode",
        "if channel is not None and key != channel.key:",
        "if False:",
        "tests/test_gateway.py::test_a_command_agent_reaches_its_own_episode_and_nothing_else",
        "an episode's own port takes another episode's key: a key an agent learns of is spent as its owner's"),
    Mutation(
        "command-unisolated",
        "envkit/agents/agent.py::Command.__call__",
        "mode = await asyncio.to_thread(isolation) if self.isolate else None",
        "mode = None",
        "tests/test_gateway.py::test_a_command_agent_reaches_its_own_episode_and_nothing_else",
        "agent processes run as this user on this host's network: they read peers' keys and reach the engine"),
    Mutation(
        "agent-told-the-answer",
        "envkit/agents/agent.py::AgentEnv.agent_task",
        "if k in self.agent_fields}",
        "if True}",
        "tests/test_gateway.py::test_a_command_agent_reaches_its_own_episode_and_nothing_else",
        "the agent is given the whole task, its answer included"),
    Mutation(
        "pythonpath-inherited",
        "envkit/agents/agent.py::Command._environ",
        "if k not in NEVER_INHERITED",
        "if k",
        "tests/test_gateway.py::test_a_command_agent_reaches_its_own_episode_and_nothing_else",
        "an inherited PYTHONPATH undoes the venv an agent runs in"),
    Mutation(
        "relative-judge-one-order",
        "envkit/rewards/judges.py::RelativeJudge._look",
        "orders = [first, first[::-1]][:self.orders]",
        "orders = [first]",
        "tests/test_judge_check.py::test_every_attack_talks_a_gullible_judge_up_without_the_defences_and_none_with_them",
        "a relative judge asks in one order: a reply's place in its group moves its score"),
    Mutation(
        "judge-reads-a-constant",
        "envkit/rewards/judges.py::LLMJudge.read",
        "value = candidates[-1]",
        "value = (low + high) / 2",
        "tests/test_rubrics.py::test_a_judge_scores_by_what_its_judge_said_so_right_replies_beat_wrong_ones",
        "a judge whose score does not depend on what its judge answered"),
    Mutation(
        "judge-reads-a-constant-vllm",
        "envkit/rewards/judges.py::LLMJudge.read",
        "value = candidates[-1]",
        "value = (low + high) / 2",
        "tests/test_rubrics.py::test_the_bundled_model_judges_through_vllm_and_answers_are_cached",
        "the same, against the bundled model judging through vLLM", needs="vLLM"),
    Mutation(
        "check-compares-no-restore",
        "envkit/cli/check.py::Checker._snapshot",
        "for label, again in plays.items():",
        "for label, again in list(plays.items())[:1]:",
        "tests/test_check.py::test_a_broken_env_fails_the_row_it_breaks_and_only_that_one[ForgetfulRestoreEnv]",
        "`envkit check` plays the restored envs but compares only the env that was snapshotted"),
    Mutation(
        "recording-duration-not-measured",
        "envkit/recording.py::Recorder.step",
        '"duration_s": time.perf_counter() - began})',
        '"duration_s": 0.0})',
        "tests/test_recording.py::test_a_slow_step_records_how_long_it_took",
        "a step's recorded duration is not the time the env took"),
    Mutation(
        "verifiers-driver-not-kept",
        "envkit/agents/process.py::HostProcess._start",
        "self.process = process",
        "pass",
        "tests/test_verifiers.py::test_a_driver_that_dies_fails_its_rollouts_alone_and_the_next_ones_start_a_new_one",
        "the host does not keep its driver: each episode starts one more, so more than one lives on",
        needs="vLLM, the verifiers venv"),
    Mutation(
        "sft-loss-sign-flipped",
        "trainer/sft.py::sft_update",
        'loss = -(logprobs * mb["loss_mask"]).sum() / tokens * weight',
        'loss = (logprobs * mb["loss_mask"]).sum() / tokens * weight',
        "tests/test_agent_recipe.py::test_the_recipe_from_the_front_door",
        "SFT minimises the demonstrations' likelihood instead of their negative log-likelihood: every step runs and "
        "logs, and the recipe's stages, evaluations and report all come out", needs="vLLM, Docker"),
    Mutation(
        "snapshot-key-per-worker",
        "envkit/remote/server/run.py::serve",
        "shared_key = config.workers > 1 and SNAPSHOT_KEY_ENV not in os.environ",
        "shared_key = False",
        "tests/test_snapshots.py::test_a_remote_session_restores_into_another_on_any_worker_or_server_with_the_key"
        "[ws-ws]",
        "each worker of `envkit serve --workers 2` draws its own snapshot key: a token restores only on the worker "
        "that sealed it"),
    Mutation(
        "attention-padding-left-nan",
        "trainer/backends/part_attention.py::_padding_zeroed",
        "return p.view(kv, rollouts, rows // longest, longest, longest).masked_fill_(padding, 0.0).view(p.shape)",
        "return p",
        "tests/test_part_attention.py::test_parts_attention_multiplies_no_inf_or_nan_of_its_padding[fp32]",
        "the padding rows of the shared-prompt attention hold inf and NaN, which a CPU's bf16 matmul carried into "
        "real rows"),
    Mutation(
        "nan-gradient-applied",
        "trainer/backends/base.py::finite_grad_norm",
        "if not math.isfinite(norm):",
        "if False:",
        "tests/test_deepspeed.py::test_one_rank_export_and_state_round_trip[2-fp32]",
        "an optimizer step with a NaN gradient is applied: the policy turns NaN and reaches the inference engine",
        needs="DeepSpeed"),
    Mutation(
        "seat-shown-every-view",
        "envkit/table.py::Table._apply",
        "            self._inbox[seat].extend(messages)",
        "            for every in self._inbox.values():\n                every.extend(messages)",
        "tests/test_seats.py::test_a_served_multi_agent_env_plays_the_same_episodes_and_shows_each_seat_its_own_view[ws]",
        "every seat of a multi-agent episode is shown every seat's messages: the listener reads the speaker's "
        "hidden target"),
    Mutation(
        "seat-trains-on-its-partners-words",
        "generators/episodes/base.py::Rollout.append",
        "self.traj.loss_mask.extend([1 if logprobs is not None else 0] * len(ids))",
        "self.traj.loss_mask.extend([1] * len(ids))",
        "tests/test_seats.py::test_each_seat_trains_on_its_own_tokens_and_sees_the_others_as_data",
        "a seat's trajectory trains on what its partner wrote (and the env's words) as if the seat had sampled it",
        needs="vLLM"),
    Mutation(
        "policies-share-one-model",
        "trainer/seated_run.py::seated_policies",
        "kind(make(start), ",
        "kind(policies[0].backend if policies else make(start), ",
        "tests/test_seats.py::test_two_policies_train_in_one_run_each_its_own_and_resume_exactly",
        "the policies of a multi-agent run are one model trained on every seat's rollouts: two policies in name only"),
    Mutation(
        "seat-starts-not-observed",
        "trainer/seated_run.py::SeatedRun.rollouts",
        "stream.observe(start, [t for e in episodes[i * samples:(i + 1) * samples] for t in e.values()])",
        "pass",
        "tests/test_seats.py::test_two_policies_train_in_one_run_each_its_own_and_resume_exactly",
        "a run with seats draws from a curriculum that is never told how its starts went: it samples blind"),
    Mutation(
        "seat-sft-weights-dropped",
        "trainer/stages.py::handed_on",
        'by_policy[results["policy"]] = results["weights"]',
        "pass",
        "tests/test_seats.py::test_two_policies_train_in_one_run_each_its_own_and_resume_exactly",
        "the sft stage trains a seat's policy and the rl stage starts it from the base model all the same"),
    Mutation(
        "seat-agent-ignored",
        "trainer/seated_run.py::SeatedRun.players",
        "AgentPlayer(self.agents[seat], player) if seat in self.agents else player",
        "player",
        "tests/test_seats.py::test_two_policies_train_in_async_mode_on_ray_and_checkpoint_every_seats_drawn_groups",
        "a seat bound to an agent that owns its loop is played by its policy directly: the agent never runs",
        needs="Ray, DeepSpeed"),
    Mutation(
        "lora-adapter-not-reloaded",
        "trainer/policy.py::AdapterPolicy.save_weights_for_sampler",
        "        runner.run(self.engine.load_weights(path, version))\n"
        "        for old in (self.out / \"adapters\").glob(\"v*\"):\n"
        "            if old != path:\n"
        "                shutil.rmtree(old, ignore_errors=True)",
        "        if version == 0:\n"
        "            runner.run(self.engine.load_weights(path, version))\n"
        "        self.engine._version = version",
        "tests/test_seats.py::test_two_policies_as_lora_adapters_of_one_vllm_server_each_serve_what_trained",
        "a policy served as a LoRA adapter is tagged with each new version but the server keeps its first adapter: "
        "every rollout after step 1 comes from the untrained policy",
        needs="vLLM"),
    Mutation(
        "serving-opt-out-ignored",
        "generators/serving/server.py::PolicyServer._answer",
        "            conversation.captured = False  # its later calls carry this one's text: none of them is kept",
        "            pass",
        "tests/test_serving.py::test_calls_are_stored_exactly_with_consent_redacted_first_and_scored_only_by_their_"
        "client",
        "a call sent with x-envkit-capture: off is stored like any other: a client's opt-out is ignored",
        needs="vLLM"),
    Mutation(
        "serving-redaction-skipped",
        "generators/serving/server.py::PolicyServer._capture",
        "        if self.config.redact is not None:",
        "        if False:",
        "tests/test_serving.py::test_calls_are_stored_exactly_with_consent_redacted_first_and_scored_only_by_their_"
        "client",
        "the redaction hook never runs: what it should remove is written to the store",
        needs="vLLM"),
    Mutation(
        "serving-feedback-from-anyone",
        "generators/serving/store.py::CallStore.feedback",
        "            if owner is None or owner[0] != client:",
        "            if owner is None:",
        "tests/test_serving.py::test_calls_are_stored_exactly_with_consent_redacted_first_and_scored_only_by_their_"
        "client",
        "feedback on a response is taken from any client's key: anyone can set another client's rewards",
        needs="vLLM"),
    Mutation(
        "curriculum-draws-lost-on-resume",
        "trainer/curriculum.py::Band.load_state",
        "        self.rng.setstate((version, tuple(inner), gauss))",
        "        del version, inner, gauss",
        "tests/test_trainer.py::test_kill_9_then_resume_reproduces_the_next_step",
        "a resumed run's band sampler starts its draws over: after a crash it trains on other tasks than the run "
        "it resumes would have"),
    Mutation(
        "curriculum-band-ignores-pass-rates",
        "trainer/curriculum.py::Band.set_aside",
        "        return \"solved\" if rate > high else \"hopeless\" if rate < low else None",
        "        return None",
        "tests/test_curriculum.py::test_the_band_draws_tasks_whose_groups_vary_and_sets_the_solved_and_hopeless_aside",
        "the band sampler draws solved and hopeless tasks like any other: their flat groups teach nothing"),
    Mutation(
        "curriculum-band-has-no-floor",
        "trainer/curriculum.py::Band.draw",
        "        if len(active) < self.cfg.min_active and aside:",
        "        if False:",
        "tests/test_curriculum.py::test_a_band_its_policy_emptied_keeps_min_active_tasks_the_set_aside_nearest_it_"
        "rejoining_first",
        "a band its policy emptied trains on its last few tasks over and over: flat groups climb back"),
    Mutation(
        "curriculum-band-ignores-groups",
        "trainer/curriculum.py::Band._distance",
        "        prior = priors.get(self.groups.get(key, \"\"), pool_rate)",
        "        prior = pool_rate",
        "tests/test_curriculum.py::test_grouped_the_floor_brings_back_the_group_whose_set_aside_tasks_came_back_"
        "passing",
        "a band on a mixture of levels brings back hopeless tasks of every level alike: flat groups stay high once "
        "the tasks in reach are spent"),
    Mutation(
        "curriculum-comebacks-count-the-solved",
        "trainer/curriculum.py::Band.draw",
        "if reasons[i] == \"hopeless\" and (key := self.keys[i]) in self.groups)",
        "if reasons[i] is not None and (key := self.keys[i]) in self.groups)",
        "tests/test_curriculum.py::test_grouped_the_floor_brings_back_the_group_whose_set_aside_tasks_came_back_"
        "passing",
        "a level whose solved tasks are retried looks like one whose hopeless tasks came within reach: the floor "
        "brings back its hopeless first"),
    Mutation(
        "curriculum-bandit-forgets-recency",
        "trainer/curriculum.py::Bandit._cell",
        "        state = reason or (\"recent\" if self.step - self.seen_at.get(key, -RECENT_STEPS - 1) <= RECENT_STEPS",
        "        state = reason or (\"recent\" if False",
        "tests/test_curriculum.py::test_the_bandit_draws_again_soon_the_tasks_whose_groups_just_varied",
        "the bandit draws the band's tasks in random order: a task whose group just varied waits until the policy "
        "has solved it, and its next group is flat"),
    Mutation(
        "curriculum-bandit-draws-a-cell-in-random-order",
        "trainer/curriculum.py::Bandit._members",
        "                ids.sort(key=lambda i: -abs(self._rate_or_even(i) - 0.5))",
        "                pass",
        "tests/test_curriculum.py::test_the_bandit_draws_first_the_tasks_of_a_cell_whose_latest_rate_is_nearest_even",
        "the bandit draws a band cell's tasks in random order: a task at 7 of 8, likely solved by now, as soon as one "
        "at 4 of 8"),
    Mutation(
        "curriculum-bandit-ignores-variance",
        "trainer/curriculum.py::Bandit.observe",
        "            self.cells[cell][len(set(rewards)) <= 1] += 1",
        "            self.cells[cell][0] += 1",
        "tests/test_curriculum.py::test_the_bandit_draws_from_the_cells_whose_groups_vary_and_moves_when_the_policy_"
        "does",
        "the bandit counts every group as varied: it draws from each cell alike, the solved and hopeless included"),
    Mutation(
        "rollouts-log-leaves-out-the-failed",
        "trainer/metrics.py::RunLogger.log_step",
        "                write_jsonl(trajectories, self.out / \"rollouts\" / f\"step-{step:06d}.jsonl\")",
        "                write_jsonl([t for t in trajectories if not t.failed], self.out / \"rollouts\" / "
        "f\"step-{step:06d}.jsonl\")",
        "tests/test_cluster.py::test_a_run_across_three_container_nodes_places_each_role_and_survives_two_kills",
        "logging.rollouts writes only the rollouts the step trained on: the failures a user would look for are not "
        "there"),
    Mutation(
        "image-inputs-walk-the-whole-tree",
        "sandboxes/images.py::_project_files",
        "        dirs[:] = [d for d in dirs",
        "        _ = [d for d in dirs",
        "tests/test_sandbox_docker.py::test_an_images_inputs_are_the_projects_sources_and_nothing_it_ran_or_built",
        "an env image's tag hashes whatever lies in the project's tree, runs/ and the built docs site included: a docs "
        "build rebuilds every image, and a checkout with gigabytes of runs takes seconds to check"),
    Mutation(
        "distill-ignores-the-teacher",
        "trainer/distill.py::token_advantages",
        "    return distill.reward_weight * env - distill.kl_weight * kl, kl",
        "    return distill.reward_weight * env, kl",
        "tests/test_distill.py::test_distillation_trains_on_the_teachers_kl_and_on_groups_rl_drops_as_flat",
        "distillation logs the teacher's KL but trains on the env's reward alone: the student never moves toward "
        "its teacher"),
    Mutation(
        "distill-trusts-the-teacher",
        "trainer/distill.py::ServedTeacher._one",
        "        if not bool(torch.all(out <= 0)):",
        "        if False:",
        "tests/test_distill.py::test_a_teacher_server_that_fails_or_lies_ends_the_run_clearly_and_one_that_wants_a_"
        "key_gets_it",
        "a teacher server's logprob of 1e9 (or NaN) goes into the advantages: the update follows whatever it says"),
    Mutation(
        "distill-tokenizer-unchecked",
        "trainer/distill.py::check_tokenizers",
        "    _refuse(differences, name)",
        "    _refuse([], name)",
        "tests/test_distill.py::test_a_teacher_with_another_tokenizer_fails_at_start_with_a_clear_message",
        "a teacher with another vocabulary or chat template is accepted: its logprobs score other tokens than the "
        "student sampled"),
]


class AnchorError(Exception):
    """The mutation's symbol, or its snippet within it, is not in the file (once)."""


def symbol_span(source: str, symbol: str) -> tuple[int, int]:
    """The character span of ``symbol`` (``Class.method``, ``function``) in ``source``, decorators included."""
    body: list[ast.stmt] = ast.parse(source).body
    node: ast.stmt | None = None
    for part in symbol.split("."):
        found = [n for n in body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
                 and n.name == part]
        if len(found) != 1:
            raise AnchorError(f"{symbol}: {len(found)} definitions of {part!r} where one was expected")
        node = found[0]
        body = node.body
    assert node is not None and node.end_lineno is not None
    first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    starts = [0]
    for line in source.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    return starts[first - 1], starts[node.end_lineno]


def mutated(source: str, mutation: Mutation) -> str:
    """``source`` with ``mutation`` applied inside its symbol."""
    start, end = symbol_span(source, mutation.symbol)
    count = source.count(mutation.old, start, end)
    if count != 1:
        raise AnchorError(f"{mutation.anchor}: the snippet {mutation.old!r} is there {count} times, not once")
    at = source.index(mutation.old, start, end)
    return source[:at] + mutation.new + source[at + len(mutation.old):]


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def backup_paths(path: Path) -> tuple[Path, Path]:
    """The original's copy and the note saying which file it belongs to and what its mutant holds."""
    stem = path.relative_to(ROOT).as_posix().replace("/", "__")
    return BACKUPS / f"{stem}.orig", BACKUPS / f"{stem}.json"


def recover() -> None:
    """Put back the originals a killed run left mutated: only where the file still holds the mutant it wrote (a file
    edited since is left alone, and said so)."""
    for note in sorted(BACKUPS.glob("*.json")):
        record = json.loads(note.read_text())
        path, original = Path(record["path"]), note.with_suffix(".orig")
        if path.exists() and digest(path.read_text()) == record["mutant"]:
            shutil.copy2(original, path)
            print(f"restored {path.relative_to(ROOT)}, which a killed run left mutated")
        else:
            sys.exit(f"{path} has changed since a killed run mutated it: compare it with {original}, then delete "
                     f"{note} and {original}")
        original.unlink()
        note.unlink()


STOP_GRACE_S = 30.0
"""Seconds a test interrupted by SIGINT has to tear down (stop the servers it started) before it is killed."""
_stopping: list[str] = []
"""The signal that asked this run to stop, once one did."""
_child: list[subprocess.Popen[str]] = []
"""The pytest run in progress."""


def stop(signum: int, frame: FrameType | None) -> None:
    """SIGINT/SIGTERM: interrupt the test (as Ctrl-C would, so that its fixtures tear down) and stop after it. No
    exception is raised here: one raised mid-restore would leave the mutant in place."""
    _stopping.append(signal.Signals(signum).name)
    for child in _child:
        if child.poll() is None:
            child.send_signal(signal.SIGINT)


def run_test(test: str) -> tuple[int, str]:
    """pytest's exit status and output for ``test``, run on this tree (its product code first on the path, for
    subprocesses too) and writing no bytecode: a mutant's .pyc must not outlive it."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    # A session of its own: a Ctrl-C at the terminal reaches this process alone, which passes on one SIGINT (a second
    # one would cut the test's teardown short)
    child = subprocess.Popen([str(PYTEST), "-q", "-x", test], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    _child.append(child)
    chunks: list[str] = []
    try:
        while True:
            try:
                out, _ = child.communicate(timeout=STOP_GRACE_S if _stopping else None)
                chunks.append(out)
                break
            except subprocess.TimeoutExpired:  # interrupted and not done tearing down: ended
                child.kill()
    finally:
        _child.remove(child)
        if child.poll() is None:
            child.kill()
            child.wait()
    return child.returncode, "".join(chunks)


SUMMARY = re.compile(r"^=* ?(\d+ (?:failed|passed|skipped|errors?|deselected).*) in [\d.]+s\b", re.MULTILINE)
"""pytest's last line of counts ("1 failed in 3.20s", "= 1 error in 9.1s ="): the tests it ran, by outcome."""


def verdict(code: int, out: str) -> str:
    """What the test run says of the mutant. Only a failed test kills it: an error (a fixture that could not set up,
    as with no vLLM) or a skip means the test never ran against it."""
    counts = SUMMARY.findall(out)
    summary = counts[-1] if counts else ""
    if code == 1 and " failed" in f" {summary}":
        return "killed"
    if code == 0 and "passed" in summary:
        return "SURVIVED"
    if code == 0:
        return "skipped"
    return f"error (pytest exit {code}{': ' + summary if summary else ''})"


def first_error(out: str) -> str:
    """The first ``E`` line of pytest's report: why the test failed, to tell a kill from an accident."""
    return next((line[1:].strip() for line in out.splitlines() if line.startswith("E ")), "")


def attempt(mutation: Mutation, baselines: dict[str, tuple[str, str]]) -> tuple[str, str]:
    """Run ``mutation``'s test unmutated (once per test: ``baselines`` holds what it gave), then apply the mutation,
    run the test, restore the file: the verdict and the first error line."""
    path = mutation.path
    source = path.read_text()
    try:
        mutant = mutated(source, mutation)
    except (AnchorError, SyntaxError, OSError) as e:
        return "anchor missing", str(e)
    if mutation.test not in baselines:
        code, out = run_test(mutation.test)
        baselines[mutation.test] = verdict(code, out), first_error(out)
    unmutated, why = baselines[mutation.test]
    if unmutated != "SURVIVED":  # "survived" with no mutant in: the test passes on the product as it is
        shown = "fails" if unmutated == "killed" else unmutated
        return f"not a kill: the test {shown} unmutated", why
    original, note = backup_paths(path)
    BACKUPS.mkdir(parents=True, exist_ok=True)
    shutil.copy2(path, original)  # copy2: the restored file keeps its mtime, so its cached bytecode stays valid
    note.write_text(json.dumps({"path": str(path), "mutant": digest(mutant)}))
    try:
        path.write_text(mutant)
        code, out = run_test(mutation.test)
    finally:
        shutil.copy2(original, path)
        original.unlink()
        note.unlink()
    return verdict(code, out), first_error(out)


def table(rows: list[tuple[str, ...]]) -> Iterator[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for k, row in enumerate(rows):
        yield "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        if k == 0:
            yield "  ".join("-" * width for width in widths)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--only", action="append", metavar="NAME", help="run only this mutation (repeatable)")
    args = parser.parse_args(argv)
    names = [m.name for m in MUTATIONS]
    unknown = sorted(set(args.only or []) - set(names))
    if unknown:
        parser.error(f"no mutation {', '.join(unknown)}; there are: {', '.join(names)}")
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    if args.list:
        for m in chosen:
            needs = f" (needs {m.needs})" if m.needs else ""
            print(f"{m.name}{needs}\n  {m.anchor}: {m.bug}\n  must fail: {m.test}")
        return 0
    recover()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, stop)
    rows = [("mutation", "test", "result", "first error")]
    baselines: dict[str, tuple[str, str]] = {}
    for m in chosen:
        print(f"{m.name}: {m.test} ...", flush=True)
        result, why = attempt(m, baselines)
        rows.append((m.name, m.test.split("::", 1)[1], result, why[:100]))
        if _stopping:
            rows[-1] = (*rows[-1][:2], f"stopped by {_stopping[0]}", "")
            break
    print("\n".join(table(rows)))
    if _stopping:
        print(f"stopped by {_stopping[0]}: every file is restored", file=sys.stderr)
        return 130
    return 0 if all(row[2] == "killed" for row in rows[1:]) else 1


if __name__ == "__main__":
    sys.exit(main())
