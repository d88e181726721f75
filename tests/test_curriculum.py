"""The task samplers (trainer/curriculum.py): the band draws the tasks whose groups vary and sets the solved and the
hopeless aside, retrying them now and then; pass rates start from ``envkit eval --pass-rates`` files and stay live;
a sampler's state resumes its draws exactly; a sampler of one's own plugs in by name. Exact resume inside a training
run is in test_trainer (``test_kill_9_then_resume_reproduces_the_next_step``)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

import trainer
from trainer.config import ConfigError, CurriculumConfig
from trainer.curriculum import Band, Sampler, Uniform, make_sampler
from trainer.sources import Mixture, TaskStarts

TASKS = TaskStarts([{"id": f"t{i}"} for i in range(10)])
LEVELS = TaskStarts([{"id": f"l{i}", "level": i % 2} for i in range(40)])  # two groups, alternating


def _band(tasks: TaskStarts = TASKS, **kwargs: object) -> Band:
    kwargs.setdefault("min_active", 0)  # the floor has its own test: 10 tasks are fewer than its default
    sampler = make_sampler(CurriculumConfig(sampler="band", **kwargs), tasks, seed=0)  # type: ignore[arg-type]
    assert isinstance(sampler, Band)
    return sampler


def _play(sampler: Sampler, index: int, passed: int, tried: int = 4, tasks: TaskStarts = TASKS) -> None:
    sampler.observe(tasks[index], [1.0] * passed + [0.0] * (tried - passed))


def test_the_band_draws_tasks_whose_groups_vary_and_sets_the_solved_and_hopeless_aside():
    band = _band(retry=0.0)
    for i in range(10):  # 0-2 always solved, 3-5 never, 6-9 half the time
        _play(band, i, 4 if i < 3 else 0 if i < 6 else 2)
    drawn = Counter(band.draw(40))
    assert set(drawn) == {6, 7, 8, 9} and set(drawn.values()) == {10}  # each in-band task as often as the others
    assert band.metrics() == {"tasks_at_0": 3, "tasks_between": 4, "tasks_at_1": 3, "tasks_untried": 0,
                              "solved_aside": 3, "hopeless_aside": 3, "retried": 0, "rejoined": 0,
                              **{f"{count}_from_{origin}": 0 for count in ("groups", "flat", "passed")
                                 for origin in ("band", "rejoined", "retried")}}
    _play(band, 3, 4, tried=8)  # a hopeless task that became learnable: 4 passes in the 12 outcomes it has
    assert 3 in band.draw(40)


def test_a_band_its_policy_emptied_keeps_min_active_tasks_the_set_aside_nearest_it_rejoining_first():
    band = _band(retry=0.0, min_active=5)
    tries = {0: (0, 4), 1: (0, 4), 2: (0, 4), 3: (0, 16), 4: (0, 16), 5: (0, 16), 6: (1, 12), 7: (16, 16),
             8: (16, 16), 9: (2, 4)}  # only 9 is in the band
    for i, (passed, tried) in tries.items():
        _play(band, i, passed, tried)
    drawn = Counter(band.draw(50))
    # nearest: 6 passed once; then the never-passed tried least (each rate pulled toward the pool's 35/108)
    assert set(drawn) == {0, 1, 2, 6, 9} and set(drawn.values()) == {10}
    assert band.metrics()["rejoined"] == 4 and band.metrics()["hopeless_aside"] == 7
    wider = _band(retry=0.0, min_active=8)
    wider.rates.load_state(band.rates.state())
    drawn = Counter(wider.draw(80))
    assert set(drawn) == {0, 1, 2, 3, 4, 5, 6, 9} and set(drawn.values()) == {10}  # the solved last
    unfloored = _band(retry=0.0)
    unfloored.rates.load_state(band.rates.state())
    assert set(unfloored.draw(8)) == {9}  # without the floor: the one task in the band, over and over


def test_the_band_counts_its_groups_and_their_flat_ones_by_why_it_drew_them():
    band = _band(retry=0.0, min_active=3)
    for i in range(10):
        _play(band, i, 2 if i >= 8 else 0)  # 8 and 9 in the band, the rest hopeless
    drawn = band.draw(6)  # the floor brings one back: three tasks, each twice
    for i in drawn:
        _play(band, i, 2 if i >= 8 else 0, tried=8)  # the rejoined one fails again: a flat group
    metrics = band.metrics()
    assert {name: n for name, n in metrics.items() if "_from_" in name} == {
        "groups_from_band": 4, "groups_from_rejoined": 2, "groups_from_retried": 0,
        "flat_from_band": 0, "flat_from_rejoined": 2, "flat_from_retried": 0,
        "passed_from_band": 0, "passed_from_rejoined": 0, "passed_from_retried": 0}
    assert band.metrics()["groups_from_band"] == 0  # counted per step: the metrics read them out
    retrying = _band(retry=1.0)
    for i in range(10):
        _play(retrying, i, 4 if i < 5 else 2)
    for i in retrying.draw(2):  # both set-aside tasks, solved: they pass again
        _play(retrying, i, 8, tried=8)
    metrics = retrying.metrics()
    assert metrics["flat_from_retried"] == metrics["passed_from_retried"] == 2


def test_grouped_the_floor_brings_back_the_group_whose_set_aside_tasks_came_back_passing():
    band = _band(LEVELS, retry=0.0, min_active=4, group_by=["level"])
    control = _band(LEVELS, retry=0.0, min_active=4)
    for sampler in (band, control):
        for i in range(40):
            _play(sampler, i, 0, tasks=LEVELS)  # every task hopeless in the starting profile
    levels: dict[Band, list[int]] = {band: [], control: []}
    for _ in range(6):
        for sampler, seen in levels.items():
            for i in sampler.draw(4):  # four set-aside tasks rejoin: level 1's pass once in 8, level 0's never
                seen.append(i % 2)
                _play(sampler, i, i % 2, tried=8, tasks=LEVELS)
    assert levels[band][:4] == levels[control][:4] == [0, 0, 1, 1]  # the first comebacks: ties, in random order
    assert levels[band][4:] == [1] * 20  # then only level 1, whose set-aside tasks came back passing
    metrics = band.metrics()
    assert (metrics["comeback_rate/0"], metrics["comeback_rate/1"]) == (0.0, 0.125)  # level 1's passed 1 in 8
    assert not any(name.startswith("comeback") for name in control.metrics())
    assert levels[control][4:].count(0) >= 4  # ungrouped: level 0's untried-since rejoin as often as level 1's
    solved = _band(LEVELS, group_by=["level"])
    for i in range(40):
        _play(solved, i, 4, tasks=LEVELS)  # every task solved: all of them retried
    for i in solved.draw(8):  # passing again, they say nothing of whether a level's hopeless came within reach
        _play(solved, i, 8, tried=8, tasks=LEVELS)
    assert not any(name.startswith("comeback") for name in solved.metrics())
    with pytest.raises(ConfigError, match=r"group_by=\['difficulty'\]: none of this env's 40 train tasks"):
        _band(LEVELS, group_by=["difficulty"])
    assert _band(LEVELS, group_by=["level", "id"]).groups["l3"] == "1,l3"  # several fields name a group together
    with pytest.raises(ConfigError, match=r"group_by is a list of task fields: \[level\], not 'level'"):
        CurriculumConfig(group_by="level")  # type: ignore[arg-type]


def test_the_bandit_draws_from_the_cells_whose_groups_vary_and_moves_when_the_policy_does():
    def run(sampler: Sampler, outcome: dict[int, int], steps: int) -> tuple[list[int], int]:
        drawn, flat = [], 0
        for _ in range(steps):
            for i in sampler.draw(4):
                drawn.append(i % 2)
                flat += outcome[i % 2] in (0, 8)
                _play(sampler, i, outcome[i % 2], tried=8, tasks=LEVELS)
        return drawn, flat

    bandit = make_sampler(CurriculumConfig(sampler="bandit", group_by=["level"]), LEVELS, seed=0)
    band = _band(LEVELS, group_by=["level"])  # the control: the band's fixed retry rate and floor
    for sampler in (bandit, band):
        for i in range(40):
            _play(sampler, i, 2 * (i % 2), tasks=LEVELS)  # level 0's tasks hopeless, level 1's in the band
    # level 1's groups vary, and its draws are all the band holds; level 0's fail
    drawn, flat = run(bandit, {0: 0, 1: 4}, 10)
    assert drawn[8:].count(1) >= 0.9 * len(drawn[8:])
    # the policy learns: level 1's tasks now pass every time (set aside as solved), and level 0's came within reach
    drawn, flat = run(bandit, {0: 4, 1: 8}, 20)
    _, control_flat = run(band, {0: 4, 1: 8}, 20)
    assert drawn[-40:].count(0) >= 0.9 * 40  # the bandit moved to level 0's set-aside tasks, whose groups vary
    assert flat <= control_flat / 2, (flat, control_flat)
    metrics = bandit.metrics()
    assert metrics["cell_varied/0/hopeless"] > 0.8 > 0.25 >= metrics["cell_varied/1/solved"]


def test_the_bandit_draws_again_soon_the_tasks_whose_groups_just_varied():
    def flat_groups(sampler: Sampler) -> int:
        last: dict[int, int] = {}
        flat = 0
        for step in range(30):
            for i in sampler.draw(4):  # a task varies when new or drawn again within 3 steps; later it is solved
                passed = 4 if i not in last or step - last[i] <= 3 else 8
                flat += passed == 8
                last[i] = step
                _play(sampler, i, passed, tried=8, tasks=LEVELS)
        return flat

    bandit = make_sampler(CurriculumConfig(sampler="bandit"), LEVELS, seed=0)
    band = _band(LEVELS)  # the control: the band draws its tasks in random order
    for sampler in (bandit, band):
        for i in range(40):
            _play(sampler, i, 2, tasks=LEVELS)
    assert flat_groups(bandit) <= 5 < 30 <= flat_groups(band)  # of 120 groups each


def test_the_bandit_draws_first_the_tasks_of_a_cell_whose_latest_rate_is_nearest_even():
    bandit = make_sampler(CurriculumConfig(sampler="bandit"), TASKS, seed=0)
    for i, passed in enumerate([1, 7, 4, 2, 6, 1, 7, 4, 7, 1]):  # all in the band, in one cell
        _play(bandit, i, passed, tried=8)
    drawn = bandit.draw(4)  # 4 of 8 first, then 2 and 6 of 8: 7 of 8 most likely passes next, 1 of 8 fails
    assert sorted(drawn[:2]) == [2, 7] and sorted(drawn[2:]) == [3, 4]


def test_set_aside_tasks_are_retried_at_the_configured_rate_and_untried_ones_are_drawn():
    band = _band(retry=0.25)
    for i in range(5):
        _play(band, i, 4)  # solved; 5-9 untried: drawn until tried min_tries times
    drawn = [i for _ in range(100) for i in band.draw(4)]  # 100 steps of 4 prompts
    retried = sum(i < 5 for i in drawn)
    assert 60 < retried < 140 and band.metrics()["retried"] == retried  # 100 expected of 400
    assert band.metrics()["retried"] == 0  # counted per step: the metrics read it out
    assert all(len(set(band.draw(4))) == 4 for _ in range(50))  # never the same task twice in a step
    assert _band(retry=0.0, min_tries=8).set_aside("t0") is None  # untried
    everything = _band(retry=0.0)
    for i in range(10):
        _play(everything, i, 4)
    assert sorted(everything.draw(12)[:10]) == list(range(10))  # all solved: each retried before any twice
    assert everything.metrics()["retried"] == 12


def test_a_sampler_resumed_from_its_state_draws_what_the_original_draws_next():
    makes = [(TASKS, lambda: _band()), (TASKS, lambda: _band(min_active=6)),
             (LEVELS, lambda: _band(LEVELS, min_active=6, group_by=["level"])),
             (LEVELS, lambda: make_sampler(CurriculumConfig(sampler="bandit", group_by=["level"]), LEVELS, seed=1)),
             (TASKS, lambda: make_sampler(CurriculumConfig(), TASKS, seed=3))]
    for tasks, make in makes:
        original = make()
        for step in range(7):
            drawn = original.draw(3)
            for i in drawn[:-1]:  # the last one's outcomes still to come
                _play(original, i, step % 5, tasks=tasks)
        state = json.loads(json.dumps(original.state()))  # as it comes back from state.json
        original.metrics()  # a step's counts are read out after its checkpoint: resumed, the next counts its own
        resumed = make()
        resumed.load_state(state)
        assert resumed.draw(12) == original.draw(12)
        assert resumed.metrics() == original.metrics()
    assert isinstance(make(), Uniform)


def test_pass_rates_start_from_an_eval_file_and_a_file_of_other_tasks_is_refused(tmp_path: Path):
    profile = tmp_path / "rates.json"
    profile.write_text(json.dumps({"env": "x", "split": "train", "pass_threshold": 1.0, "tasks": {
        "t0": {"passed": 8, "tried": 8}, "t1": {"passed": 0, "tried": 8}, "t2": {"passed": 3, "tried": 8}}}))
    band = _band(pass_rates=[str(profile)], retry=0.0)
    assert band.set_aside("t0") == "solved" and band.set_aside("t1") == "hopeless" and band.set_aside("t2") is None
    assert not {0, 1} & set(band.draw(20))
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"tasks": {"test-1-0": {"passed": 1, "tried": 1}}}))
    with pytest.raises(ConfigError, match=r"name none of this env's 10 train tasks: profile the split it trains on"):
        _band(pass_rates=[str(other)])
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ConfigError, match=r"curriculum\.pass_rates: cannot read"):
        _band(pass_rates=[str(tmp_path / "bad.json")])


class Reversed(Sampler):
    """A sampler of one's own: the train tasks from the last."""

    def draw(self, k: int) -> list[int]:
        return [len(self.starts) - 1 - i % len(self.starts) for i in range(k)]


def test_a_sampler_of_ones_own_plugs_in_by_name_and_bad_names_or_settings_are_refused():
    assert make_sampler(CurriculumConfig(sampler=f"{__name__}:Reversed"), TASKS, seed=0).draw(3) == [9, 8, 7]
    with pytest.raises(ConfigError, match=r"is not a trainer.curriculum.Sampler subclass"):
        make_sampler(CurriculumConfig(sampler="json:loads"), TASKS, seed=0)
    with pytest.raises(ConfigError, match=r"curriculum.sampler='nowhere:Thing': ModuleNotFoundError"):
        make_sampler(CurriculumConfig(sampler="nowhere:Thing"), TASKS, seed=0)
    for override, message in (("curriculum.band=[0.9,0.1]", r"curriculum.band must be \[low, high\]"),
                              ("curriculum.retry=2", r"curriculum.retry must be in \[0, 1\]"),
                              ("curriculum.min_active=-1", r"curriculum.min_active must be >= 0"),
                              ("curriculum.min_tries=20", r"min_tries \(20\) cannot exceed curriculum.window")):
        with pytest.raises(ConfigError, match=message):
            trainer.compose([override])


async def test_refill_draws_a_prompt_again_for_each_flat_group_and_counts_what_it_cost():
    """Dynamic sampling on real rollouts: the tiny model never answers an arithmetic problem right, so the env's
    own grade makes every group flat, and each refill round draws one more prompt per flat group (tasks the band
    set aside as hopeless are not drawn again). With a reward that varies (tiny:graded), nothing is drawn again."""
    from tiny import tiny_model_dir

    from generators import ChatTokenizer, Generator, GeneratorConfig
    from generators.engines.hf import HFEngine

    band = CurriculumConfig(sampler="band", min_tries=2, retry=0.0)
    async with HFEngine(tiny_model_dir()) as engine:
        generator = Generator(engine, ChatTokenizer.from_pretrained(tiny_model_dir()),
                              GeneratorConfig(samples_per_prompt=2, max_tokens=4, seed=1))
        results = {}
        for rubric in ("env", "tiny:graded"):
            kwargs = [] if rubric == "env" else [f"+env.kwargs.rubric={rubric}"]
            mixture = Mixture(trainer.compose(kwargs).env, seed=0, curriculum=band)
            await mixture.open(pool_size=1)
            try:
                results[rubric] = (await mixture.rollouts(generator, 2, refill=2), mixture.metrics())
            finally:
                await mixture.close()
    trajs, metrics = results["env"]
    groups = Counter(t.group_id for t in trajs)
    assert len(groups) == 6 and set(groups.values()) == {2} and all(t.reward == 0 for t in trajs)
    assert sum("#refill-1" in g for g in groups) == sum("#refill-2" in g for g in groups) == 2
    assert len({t.task_id for t in trajs}) == 6  # a task set aside as hopeless is not drawn again
    assert metrics["curriculum/refilled"] == 4 and metrics["curriculum/arithmetic/hopeless_aside"] == 6
    trajs, metrics = results["tiny:graded"]
    assert len({t.group_id for t in trajs}) == 2 and metrics["curriculum/refilled"] == 0
