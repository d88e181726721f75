"""A training run's report.html in a real headless Chromium: it renders, its tables hold the run, its filters select
by phase, env and outcome (and keep the selection in the URL), and what a model wrote is text, never markup."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from playwright.sync_api import Page, sync_playwright

from generators.trajectory import Trajectory
from trainer.report import Phase, RunRecord, write_run_report

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ATTACK = '</pre><script>window.pwned = 1</script><img src=x onerror="window.pwned = 2">'


def _traj(env: str, group: int, k: int, reward: float, *, failed: bool = False) -> Trajectory:
    reply = ATTACK if (group, k) == (0, 0) else f"The answer is {group + k}."
    return Trajectory(prompt_ids=[1, 2], response_ids=[3, 4], loss_mask=[1, 1], rollout_logprobs=[-0.5, -0.5],
                      messages=[{"role": "user", "content": f"What is {group} + {k}?"},
                                {"role": "assistant", "content": reply}],
                      reward=reward, step_rewards=[reward], group_id=f"{env}/seed-{group}", sample_index=k,
                      env_name=env, stop_reason="error" if failed else "done", error="boom" if failed else None)


def _phase(key: str, title: str, groups: int) -> Phase:
    trajs = [_traj(env, g, k, float((g + k) % 2), failed=(key, env, g, k) == ("step-2", "sums", 1, 3))
             for env in ("sums", "two_digit") for g in range(groups) for k in range(4)]
    return Phase(key, title, trajs, total=len(trajs) * 2)


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    steps = [{"step": s, "reward/mean": 0.2 * s, "reward/pass_rate": 0.1 * s, "rollout/trained": 16,
              "rollout/model_tokens": 400.0, "time/generate_s": 4.0, "time/train_s": 2.0, "time/step_s": 7.0,
              "stop/done": 32, "env/sums/reward/mean": 0.3 * s, "env/two_digit/reward/mean": 0.1 * s}
             for s in (1, 2)]
    evals = [{"step": 0, "eval/accuracy": 0.25, "eval/reward": 0.4}, {"step": 2, "eval/accuracy": 0.5,
                                                                      "eval/reward": 0.6}]
    run = RunRecord(
        title="envkit train: sums, two_digit", results={"output_dir": "runs/x"}, steps=steps, evals=evals,
        config={"env": {"name": "arithmetic", "mixture": [{"label": "sums"}, {"label": "two_digit"}]},
                "trainer": {"lr": 1e-5, "steps": 2}},
        phases=[_phase("eval-0", "held-out eval at step 0", 3), _phase("step-1", "step 1", 2),
                _phase("step-2", "step 2", 2), _phase("eval-2", "held-out eval at step 2", 3)],
        curves_svg='<svg id=curve xmlns="http://www.w3.org/2000/svg" width="10" height="10"></svg>',
    )
    return write_run_report(run, tmp_path_factory.mktemp("run") / "report.html")


def test_the_page_holds_the_run(report: Path) -> None:
    page = report.read_text()
    assert page.count("<tr><td>") == 2 + 2  # two steps, two evaluations
    assert "0.25 (step 0) → 0.5 (step 2)" in page  # held-out accuracy before -> after
    assert "800 in 8.0 s of generation (100.0 tokens/s)" in page  # generation tokens over generation time
    assert "<th>env.name</th><td>arithmetic</td>" in page and "<th>trainer.lr</th><td>1e-05</td>" in page
    assert "training rollouts</th><td>64<" in page  # the steps' stop counts, not the report's sample
    assert "<script>window.pwned" not in page and "&lt;script&gt;window.pwned = 1&lt;/script&gt;" in page


def _visible(page: Page) -> int:
    return page.locator("#trajs details.traj:visible").count()


@pytest.mark.chromium
def test_filters_work_in_a_real_browser(report: Path) -> None:
    assert CHROMIUM, "chromium is not installed: `make test` installs it (apt-get install chromium)"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1280, "height": 1600})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(report.as_uri())
        assert page.title() == "envkit train: sums, two_digit"
        assert page.locator("svg#curve").count() == 1 and page.locator("#step-table tr").count() == 3
        total = 2 * (3 + 2 + 2 + 3) * 4
        assert _visible(page) == total and page.text_content("#showing") == f"showing {total} of {total} trajectories"

        page.select_option("#filter-phase", "step-2")
        assert _visible(page) == 16 and "#phase=step-2" in page.url
        page.select_option("#filter-env", "two_digit")
        assert _visible(page) == 8
        page.select_option("#filter-env", "sums")
        page.select_option("#filter-status", "failed")
        assert _visible(page) == 1
        failed = page.locator("#trajs details.traj:visible")
        failed.locator("summary").click()  # open it: the error is in its body
        assert "ERROR" in failed.inner_text() and "boom" in failed.inner_text()
        page.select_option("#filter-status", "passed")
        assert _visible(page) == 4  # rewards alternate 0/1 across (group + sample)

        link = page.url  # a filtered view survives a reload from its link
        page.goto("about:blank")
        page.goto(link)
        assert _visible(page) == 4 and page.input_value("#filter-env") == "sums"
        page.select_option("#filter-phase", "")
        page.select_option("#filter-env", "")
        page.select_option("#filter-status", "")
        assert _visible(page) == total and not re.search(r"#.", page.url)

        page.locator("#trajs details.traj summary").first.click()  # the model's markup is text and never runs
        assert page.evaluate("window.pwned") is None
        assert ATTACK in page.locator("#trajs details.traj").first.inner_text()
        assert page.screenshot(full_page=True)[:4] == b"\x89PNG"
        assert errors == []
        browser.close()
