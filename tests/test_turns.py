"""The per-turn profile (`python -m tg_jax.evaluation.turns`): hand-written episodes through
the real multi-turn loop, and the user's command on a saved model."""

import json
import os

import jax
import pytest

from tg_jax import config_files
from tg_jax.envs.coding import CodingEnv, CodingEnvConfig
from tg_jax.envs.tasks import generate_tasks
from tg_jax.evaluation import turns
from tg_jax.sampling.rollout import RolloutConfig
from tg_jax.sampling.scripted import scripted_rollout
from tg_jax.text import ByteTokenizer, ChatRenderer

RENDERER = ChatRenderer(ByteTokenizer())
ROOT = os.path.join(os.path.dirname(__file__), "..")
FENCED_TEST = "```python\ndef f(x): return x\n```\nCALL run_tests"
PLAIN_TEST = "def f(x): return 1\nCALL run_tests"


def _episode(script):
    env = lambda: CodingEnv(CodingEnvConfig(requirements=("fence",), max_turns=3))  # noqa: E731
    task = generate_tasks("heldout", 1, seed=0)[0]
    config = RolloutConfig(max_new_tokens=96, max_total_tokens=1536)
    return scripted_rollout(RENDERER, env, task, script, config=config)


def test_profile_by_hand():
    episodes = [
        _episode([FENCED_TEST, PLAIN_TEST, "CALL submit"]),  # 3 turns
        _episode([FENCED_TEST, "CALL submit"]),  # 2 turns
        _episode(["```python\ndef f(x): return x\n```\nCALL submit"]),  # 1 turn
        _episode([PLAIN_TEST, "no tool here", "```python\ndef f(x): return 2\n```\nCALL submit"]),
    ]
    assert [e.num_turns for e in episodes] == [3, 2, 1, 3]
    first, second, third = turns.turn_profile(episodes, RENDERER)
    assert turns.turn_text(episodes[0], RENDERER, 1) == PLAIN_TEST
    # 1st turns: 4, all write code; fence met by 3 of 4; tools: run_tests x3, submit x1.
    assert first["episodes"] == 1.0 and first["turns"] == 4
    assert first["pass"] == pytest.approx(3 / 4) and first["code"] == 1.0
    assert first["run_tests"] == pytest.approx(3 / 4) and first["submit"] == pytest.approx(1 / 4)
    # 2nd turns: 3 (of 4 episodes); PLAIN_TEST fails the fence, the submit-only turn is not
    # judged, "no tool here" is judged (it is code to the parser) and fails: pass 0 of 2.
    assert second["episodes"] == pytest.approx(3 / 4) and second["turns"] == 3
    assert second["pass"] == 0.0
    assert second["no_tool"] == pytest.approx(1 / 3) and second["submit"] == pytest.approx(1 / 3)
    # 3rd turns: 2; one submit without code (not judged), one fenced submit (met).
    assert third["episodes"] == pytest.approx(2 / 4) and third["turns"] == 2
    assert third["pass"] == 1.0 and third["submit"] == 1.0 and third["code"] == 0.5
    table = turns.format_profile([first, second, third])
    assert table.splitlines()[1].startswith("1st") and len(table.splitlines()) == 4


@pytest.mark.slow
def test_users_command_on_a_saved_model(tmp_path):
    from tg_jax.data import task_data
    from tg_jax.models import ModelConfig, Transformer, hf_dir, init_params
    from tg_jax.text import write_byte_tokenizer

    config = config_files.load_config_file(os.path.join(ROOT, "configs", "fence.py"), "runlocal")
    work, model_dir = tmp_path / "w", tmp_path / "model"
    task_data.prepare_tasks(config, str(work))
    cfg = ModelConfig.from_config(config.model)
    hf_dir.export_model_dir(str(model_dir), init_params(Transformer(cfg), jax.random.key(0)), cfg)
    write_byte_tokenizer(str(model_dir))
    out = tmp_path / "turns.json"
    rc = turns.main([
        "--config", os.path.join(ROOT, "configs", "fence.py:runlocal"), "--workdir", str(work),
        "--model_dir", str(model_dir), "--num_tasks", "3", "--samples", "1", "--out", str(out),
    ])  # fmt: skip
    assert rc == 0
    (profile,) = json.loads(out.read_text()).values()
    assert profile["episodes"] == 3
    rows = profile["turns"]
    assert [r["turn"] for r in rows] == list(turns.POSITIONS)
    assert rows[0]["episodes"] == 1.0 and rows[0]["turns"] == 3  # every episode has a turn 1
    # Each first turn calls run_tests, submit or no tool.
    assert rows[0]["no_tool"] + rows[0]["run_tests"] + rows[0]["submit"] == pytest.approx(1.0)
