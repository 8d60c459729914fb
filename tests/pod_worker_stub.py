"""A stand-in worker for tests/test_launch.py's local pod supervision test. Every worker prints
a line; the others then mark themselves started (a file in $TG_JAX_TEST_STUB_DIR) and wait 10
minutes unless the launcher stops them; worker 1 waits for their marks, prints a line to stderr
and fails (exit 3)."""

import os
import sys
import time

if __name__ == "__main__":
    worker = int(os.environ["TG_JAX_PROCESS_ID"])
    marks = os.environ["TG_JAX_TEST_STUB_DIR"]
    others = int(os.environ["TG_JAX_NUM_PROCESSES"]) - 1
    print(f"worker {worker} starts", flush=True)
    if worker != 1:
        open(os.path.join(marks, str(worker)), "w").close()
        time.sleep(600)
        sys.exit(0)
    deadline = time.monotonic() + 60
    while len(os.listdir(marks)) < others and time.monotonic() < deadline:
        time.sleep(0.05)
    print("worker 1 fails", file=sys.stderr, flush=True)
    sys.exit(3)
