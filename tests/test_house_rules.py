"""The rules the README and docs/interfaces.md state about the code, checked instead of promised:

- imports point down only (service -> models -> convkernels; models and service never import a
  backend module; inside the kernel layer the registry picks backends; inside the service, a front
  end imports no model code beyond models.contract and nothing of the model worker): import-linter,
  with the contracts in pyproject.toml, and what importing a front end really loads;
- no undefined names, unused imports or syntax errors: ruff, with its small configuration there;
- every runtime import is a declared runtime dependency and no declared one is unused: deptry;
- no module over MAX_LINES lines, except the few named below with the reason;
- no folder of modules (service/, models/, convkernels/, benchmarks/) over MAX_FILES Python files,
  __init__.py included: past that a folder is split by what runs its files (service/: by process);
- no CONVSERVE_ setting is read below service/ (the backends and models get their knobs as
  arguments), and the few environment variables read there are other tools' own conventions;
- no comment or document cites a file that is not in the repository;
- no code or document names an issue number: each names the capability instead.

The tools run from this environment's own bin directory (the fresh venv's, in CI)."""
from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PACKAGES = ("convkernels", "models", "service")
MAX_LINES = 400
#: Python files per folder, __init__.py included (tests/ is one flat folder of test files by design)
MAX_FILES = 15
#: modules allowed past MAX_LINES, and why
OVER_BUDGET: dict[str, str] = {}
#: environment variables read below service/: each is another tool's own convention, not a setting
ENV_READS = {
    "convkernels/_cpu/__init__.py": {"OMP_WAIT_POLICY"},     # OpenMP's: idle threads must not spin
    # glibc's malloc options and NumPy's huge-page request: where a user set any, they are left alone
    "convkernels/backends/numpy/memory.py": {"GLIBC_TUNABLES", "MALLOC_*", "NUMPY_MADVISE_HUGEPAGE"},
    "convkernels/backends/cuda/blas.py": {"CUDA_PATH"},      # the CUDA toolkit's install location
    "models/hub.py": {"HF_HUB_OFFLINE", "HF_HUB_CACHE", "HF_HOME"},  # Hugging Face's cache and offline mode
}


def tool(name: str, *args: str) -> subprocess.CompletedProcess:
    exe = BIN / name
    if not exe.exists():
        pytest.fail(f"{name} is not installed in this environment ({BIN}); it is in the test extra")
    return subprocess.run([str(exe), *args], cwd=REPO, capture_output=True, text=True, timeout=600)


def sources(*roots: str, suffixes=(".py",)) -> list[Path]:
    files = subprocess.run(["git", "ls-files", *roots], cwd=REPO, capture_output=True, text=True, check=True)
    return [REPO / f for f in files.stdout.split() if f.endswith(suffixes) and (REPO / f).exists()]


def test_imports_point_down_only():
    run = tool("lint-imports")
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


def test_ruff_finds_nothing():
    run = tool("ruff", "check", ".")
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


def test_runtime_imports_match_the_declared_dependencies():
    run = tool("deptry", ".")
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


def test_modules_stay_within_the_size_budget():
    per_package: dict[str, list[int]] = defaultdict(list)
    over = {}
    for path in sources(*PACKAGES):
        rel = path.relative_to(REPO).as_posix()
        lines = len(path.read_text().splitlines())
        per_package[rel.split("/")[0] if "/backends/" not in rel else "convkernels/backends"].append(lines)
        if lines > MAX_LINES:
            over[rel] = lines
    for package, sizes in sorted(per_package.items()):
        print(f"SIZE {package}: {len(sizes)} modules, {sum(sizes)} lines, largest {max(sizes)}")
    unexplained = {m: n for m, n in over.items() if m not in OVER_BUDGET}
    assert not unexplained, f"modules over {MAX_LINES} lines: {unexplained} (split them, or name them in OVER_BUDGET)"
    stale = set(OVER_BUDGET) - set(over)
    assert not stale, f"OVER_BUDGET names modules now within the budget: {stale}"


def test_folders_stay_within_the_file_budget():
    per_folder = Counter(path.parent.relative_to(REPO).as_posix() for path in sources(*PACKAGES, "benchmarks"))
    over = {folder: n for folder, n in sorted(per_folder.items()) if n > MAX_FILES}
    assert not over, f"folders over {MAX_FILES} Python files: {over} (split them into subpackages by what runs them)"


def test_a_front_end_loads_no_model_family():
    """The import-linter contracts see imports module by module; this sees what importing a front
    end really loads, packages' __init__ modules included: no model family (nor models.sharding,
    which loads them) and nothing of the model worker."""
    code = "import sys, service.frontend.app, service.frontend.server; print(' '.join(sorted(sys.modules)))"
    loaded = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                            check=True, timeout=120).stdout.split()
    families = {p.name for p in (REPO / "models").iterdir() if (p / "__init__.py").exists()} - {"nn"}
    wrong = [m for m in loaded if m.startswith("service.worker")
             or m.startswith("models.") and m.split(".")[1] in families]
    assert not wrong, f"importing a front end loads {wrong}"


def test_no_setting_is_read_below_the_service():
    env_read = re.compile(r"""os\.environ(?:\.get|\.setdefault)?\s*[\[(]\s*["']([A-Z_]+)["']|os\.getenv\(\s*["']([A-Z_]+)""")
    problems = []
    for path in sources("convkernels", "models"):
        rel = path.relative_to(REPO).as_posix()
        text = path.read_text()
        if re.search(r"^\s*(from service|import service)", text, re.M):
            problems.append(f"{rel} imports the service")
        if re.search(r"BaseSettings|pydantic_settings", text):
            problems.append(f"{rel} defines settings of its own")
        read = {a or b for a, b in env_read.findall(text)}
        extra = read - ENV_READS.get(rel, set())
        if extra:
            problems.append(f"{rel} reads {sorted(extra)} from the environment")
    assert not problems, problems


#: names that look like files but name things outside this repository on purpose: files in a
#: checkpoint or a user's folder, and upstream sources a comment says where to find
NOT_OURS = {"autoencoder_kl_wan.py", "timm/models/convnext/model.py",  # upstream sources a comment points into
            "sitecustomize.py", "bad.py", "benchmarks/x.py"}         # files tests write, or fake ones they name
#: a path (with a slash) to a file of any of these kinds, or a bare name of a Python, Markdown or
#: CUDA file (bare `x.c`, `x.sh` are more often attributes: `self.sh`, `prep.c`)
CITED = re.compile(r"(?<![\w/.<>-])((?:\.\./|\./)*(?:[\w-]+/)+[\w-]+\.(?:md|py|cu|c|sh|toml|ya?ml|ini|cfg)"
                   r"|[\w-]+\.(?:md|py|cu))(?![\w/])")


def test_no_comment_cites_a_file_outside_the_repository():
    tracked = sources(".", suffixes=(".py", ".md", ".toml", ".sh", ".cu", ".c", ".yaml", ".yml", ".cfg"))
    names = {p.name for p in tracked}
    missing = []
    for path in tracked:
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if "http://" in line or "https://" in line:
                line = re.sub(r"https?://\S+", "", line)
            for cited in CITED.findall(line):
                if "../shared" in cited:  # the workspace beside the checkout: never the users'
                    missing.append(f"{path.relative_to(REPO)}:{n}: {cited}")
                    continue
                if cited in NOT_OURS or Path(cited).name in NOT_OURS:
                    continue
                if any((base / cited).exists() for base in (REPO, path.parent, REPO / "deploy")) or (
                        "/" not in cited and cited in names):
                    continue
                if "/" in cited and any(p.as_posix().endswith(cited) for p in tracked):
                    continue
                missing.append(f"{path.relative_to(REPO)}:{n}: {cited}")
    assert not missing, "\n".join(missing[:60]) + (f"\n... {len(missing)} in all" if len(missing) > 60 else "")


#: an issue's number, whatever the wording: "issue" or "issues" then a number (with or without its
#: hash), a hash and a number in parentheses, or a hash and two or three digits ending the word (the
#: second of "issues #a, #b", a bare one's possessive). A hex colour (#1f77b4, #00ff00) and an
#: anchor (#worker-unresponsive) are not: the digits must end the word, no hex digit after them
ISSUE_NUMBER = re.compile(r"\b[Ii]ssues? #?\d+\b|\(#\d+\)|\B#\d{2,3}\b(?![0-9a-fA-F])")
TEXT_SUFFIXES = (".py", ".md", ".sh", ".yaml", ".yml", ".toml", ".txt", ".cfg", ".cu", ".c", ".json")


def test_no_code_or_document_names_an_issue_number():
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True)
    tracked = [REPO / f for f in files.stdout.split()
               if (f.endswith(TEXT_SUFFIXES) or Path(f).name.startswith("Dockerfile")) and (REPO / f).exists()]
    named = [f"{path.relative_to(REPO)}:{n}: {m.group(0)}"
             for path in tracked
             for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
             for m in ISSUE_NUMBER.finditer(line)]
    assert not named, ("name the capability, not the issue:\n" + "\n".join(named[:60])
                       + (f"\n... {len(named)} in all" if len(named) > 60 else ""))
