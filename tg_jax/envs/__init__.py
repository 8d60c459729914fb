"""Environments: strings in, strings out.

base.py (Environment API, requirements, episode summary), sandbox.py (running model-written
Python), tasks.py (hidden-function tasks and splits), protocol.py (turn syntax, requirement
checkers, hint texts), coding.py (the coding environment), hints.py (imperfect feedback),
transcripts.py (synthetic expert transcripts for SFT).
"""
