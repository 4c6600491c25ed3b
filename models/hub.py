"""Weights named by a Hugging Face Hub reference (`org/name[/subfolder][@revision]`): parse the
reference, resolve it to a local snapshot folder through `huggingface_hub` (the standard cache,
`HF_HUB_OFFLINE`, `HF_TOKEN`), and describe exactly what was resolved (repository, commit, file
hashes) so a deployment can pin what it serves. The loaders only ever see the local folder."""
from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from .nn.weights import WeightsError

HF_SCHEME = "hf://"

#: what a weights reference may be; every parse error lists these
ACCEPTED_FORMS = (
    "an existing local path: a diffusers/HF model folder or a .safetensors file (a path that exists always wins; "
    "write ./org/name for a relative folder that may be missing)",
    "org/name, org/name/subfolder: a Hugging Face Hub repository (subfolder e.g. vae in a pipeline repository)",
    "org/name[/subfolder]@revision: pinned to a branch, tag or commit",
    "hf://org/name[/subfolder][@revision]: always the Hub, never a local path",
)

#: only these are fetched: configs and safetensors (pickle weights are never downloaded or read)
FETCHED = ("*.json", "*.safetensors")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")

# Hub names: letters, digits, '-', '_', '.'; no leading/trailing '-' or '.', no '--' or '..'
# (huggingface_hub's own repo-id rule, applied to every path part).
_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"
_REF = re.compile(rf"(?P<org>{_PART})/(?P<name>{_PART})(?P<sub>(?:/{_PART})*)"
                  r"(?:@(?P<rev>[A-Za-z0-9][A-Za-z0-9._/-]*))?")
_PATHLIKE = re.compile(r"^(?:/|\./|\.\./|~|\.$|\.\.$)|\\")


class HubError(WeightsError):
    """A Hub reference that is malformed, ambiguous, missing or unusable; the message names it."""


@dataclass(frozen=True)
class HubRef:
    repo_id: str
    subfolder: str | None = None
    revision: str | None = None

    def __str__(self) -> str:
        sub = f"/{self.subfolder}" if self.subfolder else ""
        rev = f"@{self.revision}" if self.revision else ""
        return f"{self.repo_id}{sub}{rev}"


def _forms() -> str:
    return "accepted weights forms: " + "; ".join(ACCEPTED_FORMS)


def parse_hub_ref(text: str) -> HubRef:
    """`[hf://]org/name[/subfolder][@revision]` -> HubRef; anything else is a HubError listing the forms."""
    body = text[len(HF_SCHEME):] if text.startswith(HF_SCHEME) else text
    m = _REF.fullmatch(body)
    if m is None or "--" in m["org"] + m["name"] or ".." in body:
        raise HubError(f"weights {text!r} are not a valid Hub reference; {_forms()}")
    sub = m["sub"].strip("/") or None
    return HubRef(f"{m['org']}/{m['name']}", sub, m["rev"])


def parse_weights(text: str) -> str | HubRef:
    """A weights setting as a local path (returned as given) or a HubRef. A path that exists wins;
    something that looks like a path stays one (and fails later as a missing file); a name whose
    first part exists locally but whose whole path does not is ambiguous and refused."""
    if text.startswith(HF_SCHEME):
        return parse_hub_ref(text)
    path = Path(text).expanduser()
    if path.exists() or _PATHLIKE.search(text) or path.suffix in (".safetensors", *PICKLE_SUFFIXES):
        return text
    ref = parse_hub_ref(text)
    first = Path(text.split("/", 1)[0])
    if first.exists():
        raise HubError(f"weights {text!r} are ambiguous: {first}/ exists here but {text} does not; write "
                       f"./{text} for a local path or {HF_SCHEME}{text} for the Hub; {_forms()}")
    return ref


def _offline() -> bool:
    # read now, not at import: huggingface_hub reads HF_HUB_OFFLINE once, when first imported
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def _cache_dir() -> str | None:
    """HF_HUB_CACHE, else $HF_HOME/hub, read at call time for the same reason; None = the library's default."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    return None


def _default_cache() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@dataclass(frozen=True)
class Resolved:
    """A Hub reference resolved to a local folder, and what it resolved to."""
    path: Path
    provenance: dict

    @property
    def source(self) -> str:
        p = self.provenance
        sub = f"/{p['subfolder']}" if p["subfolder"] else ""
        return f"{HF_SCHEME}{p['repo']}{sub}@{p['commit']}"


def resolve(ref: HubRef, hashes: bool = True) -> Resolved:
    """Download (or, offline, find in the cache) the `*.json` and `*.safetensors` files of `ref`
    and return their folder with provenance: repo, subfolder, requested revision, resolved
    commit, and each file's size and sha256 (`hashes=False` skips reading the files for the hash)."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:  # a runtime dependency, but say what is missing rather than crash
        raise HubError(f"weights {ref}: Hub references need the huggingface_hub package ({exc})") from exc
    prefix = f"{ref.subfolder}/" if ref.subfolder else ""
    offline = _offline()
    try:
        snapshot = Path(snapshot_download(ref.repo_id, revision=ref.revision, cache_dir=_cache_dir(),
                                          allow_patterns=[prefix + p for p in FETCHED],
                                          local_files_only=offline))
    except Exception as exc:  # every Hub failure becomes one line naming the reference
        raise HubError(_why(ref, exc, offline)) from None
    folder = snapshot / ref.subfolder if ref.subfolder else snapshot
    if not folder.is_dir():
        raise HubError(f"weights {ref}: the repository has no folder {ref.subfolder!r} at commit {snapshot.name}")
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in (".json", ".safetensors"))
    if not any(p.suffix == ".safetensors" for p in files):
        raise HubError(_no_safetensors(ref, folder, snapshot.name, offline))
    provenance = {
        "repo": ref.repo_id, "subfolder": ref.subfolder, "revision": ref.revision or "main",
        "commit": snapshot.name, "path": str(folder),
        "files": {p.name: {"size": p.stat().st_size, **({"sha256": file_sha256(p)} if hashes else {})}
                  for p in files},
    }
    return Resolved(folder, provenance)


def _why(ref: HubRef, exc: Exception, offline: bool) -> str:
    kind = exc.__class__.__name__
    if kind in ("LocalEntryNotFoundError", "IncompleteSnapshotError", "OfflineModeIsEnabled") or offline:
        how = ("HF_HUB_OFFLINE is set and it is not in the Hub cache" if offline
               else "the Hub cannot be reached and it is not in the Hub cache")
        return (f"weights {ref}: {how} ({_cache_dir() or _default_cache()}); run `convserve pull {ref}` "
                f"where the Hub is reachable, with the same HF_HOME/HF_HUB_CACHE")
    if kind == "RepositoryNotFoundError":
        return f"weights {ref}: no such repository {ref.repo_id!r} on the Hub (or it is private: set HF_TOKEN)"
    if kind == "GatedRepoError":
        return f"weights {ref}: {ref.repo_id!r} is gated: accept its terms on the Hub and set HF_TOKEN"
    if kind == "RevisionNotFoundError":
        return f"weights {ref}: {ref.repo_id!r} has no revision {ref.revision!r}"
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"weights {ref}: could not fetch from the Hub: {kind}: {first}"


def _no_safetensors(ref: HubRef, folder: Path, commit: str, offline: bool) -> str:
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if not pickles and not offline:
        try:  # only pickles were skipped by allow_patterns: name them from the repository listing
            from huggingface_hub import list_repo_files

            prefix = f"{ref.subfolder}/" if ref.subfolder else ""
            pickles = sorted(f[len(prefix):] for f in list_repo_files(ref.repo_id, revision=commit)
                             if f.startswith(prefix) and "/" not in f[len(prefix):]
                             and Path(f).suffix in PICKLE_SUFFIXES)
        except Exception:  # best effort: the error below stands without the names
            pass
    found = f" (it has pickle weights {pickles})" if pickles else ""
    return (f"weights {ref}: no .safetensors weights at commit {commit}{found}; pickle checkpoints are "
            f"refused: use a repository or revision that has safetensors, or convert them")


def resolve_weights(weights: str | None) -> tuple[str | None, Resolved | None]:
    """A weights setting -> (local path for the loaders, Resolved when it came from the Hub)."""
    if weights is None:
        return None, None
    parsed = parse_weights(weights)
    if isinstance(parsed, str):
        return parsed, None
    resolved = resolve(parsed)
    return str(resolved.path), resolved
