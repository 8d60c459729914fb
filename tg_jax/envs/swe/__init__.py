"""The agentic software-engineering environment: repositories, file tools, real tests.

task.py (SweTask records), templates.py + generator.py (procedural bug-fix repositories,
train / held-out split by template and identifier pool), importer.py (user tasks from JSONL
or a directory per task, SWE-bench FAIL_TO_PASS / PASS_TO_PASS accepted), tools.py (the
Qwen3 <tool_call> protocol and the file tools), runner.py (the test-runner seam and the light
in-sandbox pytest runner), requirements.py (the three requirement tiers: checkers and hints),
env.py (SweEnv), agents.py (scripted expert and weak agents, transcripts).
"""
