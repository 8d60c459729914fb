"""A judge that errs (`tg_jax.envs.hints.VerdictNoise`): the training environments' verdicts
flipped at set rates, a fixed function of (seed, requirement, turn text); held-out judged truly."""

import pytest

from tg_jax.config_lib import env_config
from tg_jax.envs import env_factory
from tg_jax.envs.hints import VerdictNoise, judge_unit, noisy_judge, noisy_requirement
from tg_jax.envs.protocol import make_requirement
from tg_jax.envs.tasks import generate_tasks
from tg_jax.train import pipeline

FENCED = "```python\ndef f(x): return x + {}\n```\nCALL run_tests"
BARE = "def f(x): return x + {}\nCALL run_tests"


def test_the_judge_flips_at_its_rates_and_is_a_function_of_the_text():
    fence = make_requirement("fence")
    noise = VerdictNoise(false_positive=0.1, false_negative=0.3)
    judge = noisy_requirement(fence, noise, seed=7)
    n = 4000
    met = [judge.check(FENCED.format(i)) for i in range(n)]
    failed = [judge.check(BARE.format(i)) for i in range(n)]
    assert all(fence.check(FENCED.format(i)) for i in range(5))  # the truth: met / failed
    assert not any(fence.check(BARE.format(i)) for i in range(5))
    # Binomial(4000, p): 4 standard deviations are < 0.03 at p = 0.3.
    assert 1 - sum(met) / n == pytest.approx(0.3, abs=0.03)  # false negatives
    assert sum(failed) / n == pytest.approx(0.1, abs=0.02)  # false positives
    # The same text, the same verdict; each flip is exactly the draw's.
    assert [judge.check(FENCED.format(i)) for i in range(50)] == met[:50]
    for i in range(50):
        assert met[i] == (judge_unit(7, "fence", FENCED.format(i)) >= 0.3)
        assert failed[i] == (judge_unit(7, "fence", BARE.format(i)) < 0.1)
    other = noisy_requirement(fence, noise, seed=8)
    assert [other.check(FENCED.format(i)) for i in range(200)] != met[:200]


def test_a_noisy_environment_rewards_and_gates_by_the_judges_verdicts():
    cfg = env_config(requirements=("fence",), executor="trusted", max_turns=1)
    truth = env_factory(cfg)
    # A judge that calls every met turn failed (false_negative just under 1).
    wrong = noisy_judge(truth, VerdictNoise(false_negative=0.999999), seed=0)
    task = generate_tasks("train", 1, seed=0)[0]
    turn = "```python\ndef f(x): return x\n```\nCALL submit"
    env = wrong()
    env.reset(task)
    res = env.step(turn)
    assert res.info["verdicts"] == {"fence": False} and res.rewards["fence"] == 0.0
    assert env.summary().failed_turns("fence") == [0]  # the TG gate targets it
    env = truth()
    env.reset(task)
    assert env.step(turn).info["verdicts"] == {"fence": True}
    assert noisy_judge(truth, VerdictNoise(), seed=0) is truth  # no noise: the same factory


def test_bad_rates_and_the_stress_arm():
    with pytest.raises(ValueError, match="false_positive must be in"):
        VerdictNoise(false_positive=1.0)
    with pytest.raises(ValueError, match="false_negative must be in"):
        VerdictNoise(false_negative=-0.1)
    arm = pipeline.get_arm("tg_wrong_judge")
    assert arm.group == "stress"
    assert arm.overrides["rl_loop.feedback.false_positive"] == 0.2
