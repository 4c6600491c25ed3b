"""Where a server process's CPU goes under load: py-spy sampling a running process (no restart, no
instrumentation in the service), summarised per thread.

Why sampling: the model worker's cost per request is spread over several threads (links, device,
delivery) and cProfile sees only the thread that turns it on; py-spy reads every thread's stack from
outside, at a rate that costs the process nothing.

`record(pid, seconds, path)` starts `py-spy record` on the process (raw collapsed stacks, one line
per distinct stack, thread name first) and returns the child; `summary(path)` prints each thread's
share of the samples and its heaviest functions, by own (leaf) samples and by inclusive samples.
py-spy is optional: a benchmark asks `available()` first and says why when it is not there
(it needs ptrace rights over the process, which containers may withhold)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
from collections import Counter, defaultdict


def executable() -> str | None:
    here = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return here if os.path.exists(here) else shutil.which("py-spy")


def available() -> str | None:
    """None when py-spy can run here, else why not."""
    return None if executable() else "py-spy is not installed (pip install py-spy)"


def record(pid: int, seconds: float, path: str, rate: int = 250, gil: bool = False,
           native: bool = False) -> subprocess.Popen:
    """gil: sample only the thread holding the interpreter lock. Without it, py-spy counts a
    thread blocked on the lock, a queue or a sleep as active; with it, the shares are of the
    interpreter's busy time: where a worker's Python cost per request goes."""
    # --nonblocking: the process is never paused to read its stacks (a paused worker would
    # serve fewer requests and the benchmark would measure the profiler). native: C frames too
    # (NumPy's copies, the CUDA driver: where a thread's CPU goes outside the interpreter lock);
    # py-spy must pause the process for those, so that run serves fewer requests.
    return subprocess.Popen([executable(), "record", "--pid", str(pid), "--duration", str(int(seconds)),
                             "--rate", str(rate), "--format", "raw", "--threads",
                             *(["--native"] if native else ["--nonblocking"]),
                             *(["--gil"] if gil else []), "--output", path],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


#: the threading module's own frames (every thread's bootstrap: in all of its samples, so no news)
_THREADING = f"({os.path.basename(threading.__file__)}:"
_THREAD = re.compile(r"^thread \(\w+\)(?:: (.*))?$")


def _frames(line: str) -> tuple[str, list[str], int] | None:
    """(thread, frames outermost first, samples) of one collapsed stack; None for a line that is
    not one (a frame's text may hold a line break, which splits its stack over two lines)."""
    stack, _, count = line.rstrip().rpartition(" ")
    if not count.isdigit():
        return None
    frames = stack.split(";")
    m = _THREAD.match(frames[0])
    thread = (m.group(1) or frames[0]) if m else "?"
    return thread, frames[1:] if m else frames, int(count)


def summary(path: str, top: int = 12) -> str:
    per_thread: Counter = Counter()
    own: dict[str, Counter] = defaultdict(Counter)
    inclusive: dict[str, Counter] = defaultdict(Counter)
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            parsed = _frames(line)
            if parsed is None:
                continue
            thread, frames, n = parsed
            per_thread[thread] += n
            if frames:
                own[thread][frames[-1]] += n
            for frame in set(frames):
                inclusive[thread][frame] += n
    total = sum(per_thread.values()) or 1
    out = [f"{total} samples (active threads only) in {os.path.basename(path)}"]
    for thread, n in per_thread.most_common():
        out.append(f"  thread {thread}: {n} samples, {n / total:.0%}")
        out.append("    own: " + "; ".join(f"{f} {c / n:.0%}" for f, c in own[thread].most_common(top)))
        kept = [(f, c) for f, c in inclusive[thread].most_common(top + 4) if _THREADING not in f][:top]
        out.append("    inclusive: " + "; ".join(f"{f} {c / n:.0%}" for f, c in kept))
    return "\n".join(out)


if __name__ == "__main__":
    print(summary(sys.argv[1]))
